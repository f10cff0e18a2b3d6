"""The request the demo prints to try the served model (flows/demo.py): a chat model gets the question as a
chat, through its chat template (raw text made SmolLM2-Instruct answer with its end-of-turn token at once);
a model without one gets raw text. Both are KServe v2 bodies the `llm` model and its router take."""

from __future__ import annotations

import json

from flows.demo import QUESTION, try_it_request


def test_a_chat_model_is_asked_through_messages_and_a_plain_one_through_text():
    chat = json.loads(try_it_request(chat=True))["inputs"]
    assert [i["name"] for i in chat] == ["messages", "max_tokens"]
    assert json.loads(chat[0]["data"][0]) == [{"role": "user", "content": QUESTION}]
    plain = json.loads(try_it_request(chat=False))["inputs"]
    assert [i["name"] for i in plain] == ["text_input", "max_tokens"] and plain[0]["data"] == [QUESTION]
    assert all(i["shape"] == [1, 1] for i in chat + plain)


def test_the_body_survives_the_single_quotes_it_is_printed_in():
    assert "'" not in try_it_request(chat=True) and "'" not in try_it_request(chat=False)


def test_the_demo_spec_parses_with_a_budget_a_two_core_machine_can_judge(tmp_path):
    """The demo compares latency where both versions carry half the traffic, against a 50% budget, sizes its
    evaluation and A/B down, and says so (SMALLER_THAN_PRODUCTION is printed first)."""
    from flows.demo import SMALLER_THAN_PRODUCTION, demo_spec
    from tasks.analysis import samples_needed
    from tasks.promote_spec import Analysis, SetWeight

    spec = demo_spec(tmp_path, max_batch_size=8)
    weights = [s.set_weight for s in spec.rollout.steps if isinstance(s, SetWeight)]
    analyses = [s.analysis for s in spec.rollout.steps if isinstance(s, Analysis)]
    assert weights == [10, 50, 100] and len(analyses) == 3
    compared = analyses[1].compare
    assert analyses[0].compare is None and compared is not None and compared.max_slowdown == 0.5
    # a spread of 0.6 (what the busy 2-core machine showed) needs few enough samples for a window of a minute
    assert samples_needed(1 + compared.max_slowdown, 0.6, compared.alpha, compared.power) <= compared.max_samples
    assert spec.rollout.hold.on_inconclusive == "abort"
    assert spec.evaluation.max_passages == 8 and spec.perf.max_iterations == 10
    assert not spec.perf.long_row and "on short prompts" in SMALLER_THAN_PRODUCTION
    assert len(spec.validation.prompts) == 3 and spec.validation.max_new_tokens == 8
    assert "smaller than a production spec" in SMALLER_THAN_PRODUCTION and "8 of its 16 passages" in \
        SMALLER_THAN_PRODUCTION and "validation runs 3 prompts and 1 long one for 8 tokens" in SMALLER_THAN_PRODUCTION


def test_the_demo_evaluation_has_the_units_its_power_calculation_asks_for(tmp_path):
    """The demo's fewer greedy continuations (2 a passage) are still the 16 its 0.3 budget needs at 90% power."""
    from flows.demo import demo_spec
    from tasks.evaluation import EvaluationData, check_enough_units, load_evaluation, units_needed

    spec = demo_spec(tmp_path, max_batch_size=8).evaluation
    data = load_evaluation()
    check_enough_units(spec, EvaluationData(data.passages[:spec.max_passages], data.choices[:spec.max_choices]))
    assert units_needed(spec)["greedy"] == spec.max_passages * spec.greedy_windows


def test_a_failed_demo_says_how_to_stop_the_server_it_leaves_serving(tmp_path):
    from flows.demo import demo_spec, still_serving

    message = still_serving(demo_spec(tmp_path, max_batch_size=4))
    assert "enginewright triton stop --repository" in message and "triton-repository" in message
