"""A paged step's device inputs (serving/engine/step.build_step), built in numpy from each chunk's
length, start and table, held to a per-token reference on random plans of decodes, prompts from position 0
(equal lengths grouped, in a row or not) and later chunks of long prompts (grouped by length, tables padded); and the refusal of a table too
short for its chunk."""

from __future__ import annotations

import random

import pytest
import torch

from serving.engine.step import build_step

BS = 4


def reference(chunks, sample):
    """What build_step must give, token by token."""
    tokens, positions, slots, single_rows, single_tables, single_lengths, last = [], [], [], [], [], [], []
    fresh, later = {}, {}
    for toks, start, table in chunks:
        offset = len(tokens)
        for k, tok in enumerate(toks):
            p = start + k
            tokens.append(tok)
            positions.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        if len(toks) == 1:
            single_rows.append(offset)
            single_tables.append(list(table))
            single_lengths.append(start + 1)
        elif start == 0:
            fresh.setdefault(len(toks), []).append(list(range(offset, offset + len(toks))))
        else:
            later.setdefault(len(toks), []).append((list(range(offset, offset + len(toks))), start, list(table),
                                                    -(-(start + len(toks)) // BS)))
        last.append(offset + len(toks) - 1)
    width = max((-(-n // BS) for n in single_lengths), default=0)
    single_tables = [(t + [0] * width)[:width] for t in single_tables]
    groups = []
    for members in later.values():  # each group's tables cut or padded with block 0 to the most blocks it reaches
        w = max(used for *_, used in members)
        groups.append(([r for r, *_ in members], [st for _, st, *_ in members], [(t + [0] * w)[:w] for _, _, t, _ in members]))
    return tokens, positions, slots, single_rows, single_tables, single_lengths, [last[i] for i in sample], fresh, groups


def random_plan(rng: random.Random):
    blocks = list(range(1000))
    rng.shuffle(blocks)
    take = iter(blocks)
    chunks = []
    for _ in range(rng.randrange(0, 40)):
        kind = rng.choice(("decode", "fresh", "fresh", "long"))
        start = {"decode": rng.randrange(0, 30), "fresh": 0, "long": rng.randrange(1, 20)}[kind]
        n = 1 if kind == "decode" else rng.choice((2, 5, 8, rng.randrange(2, 12)))
        held = -(-(start + n) // BS) + rng.randrange(0, 3)  # a sequence may hold blocks past its positions
        chunks.append(([rng.randrange(1, 500) for _ in range(n)], start, [next(take) for _ in range(held)]))
    sample = sorted(rng.sample(range(len(chunks)), rng.randrange(0, len(chunks) + 1)))
    return chunks, sample


@pytest.mark.parametrize("seed", range(30))
def test_the_step_inputs_equal_a_per_token_reference(seed: int):
    chunks, sample = random_plan(random.Random(seed))
    step = build_step(chunks, sample, BS, torch.device("cpu"))
    tokens, positions, slots, rows, tables, lengths, sampled, fresh, later = reference(chunks, sample)
    assert step.tokens.tolist() == tokens and step.positions.tolist() == positions and step.slots.tolist() == slots
    assert step.single_rows.tolist() == rows and step.single_lengths.tolist() == lengths
    assert step.single_tables.tolist() == tables and step.single_tables.shape == (len(rows), len(tables[0]) if tables else 0)
    assert step.sample_index.tolist() == sampled
    assert [g.tolist() for g in step.fresh_groups] == list(fresh.values())
    assert step.fresh_firsts == tuple(g[0][0] if all(r[0] == g[0][0] + k * len(r) for k, r in enumerate(g)) else None
                                      for g in fresh.values())
    assert [(r.tolist(), st.tolist(), t.tolist()) for r, st, t in step.later_groups] == later
    assert all(t.dtype == torch.long for t in (step.tokens, step.positions, step.slots, step.single_tables))


def test_a_table_too_short_for_its_chunk_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match="block table of 1 blocks does not cover positions up to 6"):
        build_step([([1, 2], 4, [7])], [0], BS, torch.device("cpu"))
