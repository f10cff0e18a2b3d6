"""`bench profile`'s variant names (serving/bench/profile_decode.py); the profile itself needs CUDA."""

from __future__ import annotations

import pytest

from serving.bench.profile_decode import attention_knobs, profile_variant


def test_attention_knob_parts_become_launch_keywords():
    parts = ["triton", "kvb64", "pdl", "kvw8", "kvst3", "kvt1024"]
    assert attention_knobs(parts) == {"block": 64, "num_warps": 8, "num_stages": 3, "target_programs": 1024}
    assert attention_knobs(["kvb", "kvx64", "skinny"]) == {}


@pytest.mark.parametrize("part", ["kvb", "gateup", "kvq8"])
def test_an_unknown_part_is_named(part):
    with pytest.raises(ValueError, match=f"unknown parts \\['{part}'\\]"):
        profile_variant(None, variant=f"dynamic+triton+{part}", batch=1, context=8, kv_block=16)
