"""The decode inputs that stay on the device between in-flight steps, one entry per cache row.

`tokens[r]` is the token row r feeds its next decode step, `positions[r]` the cache position it goes
to, `active[r]` 1 for a row that advances one position per step and 0 for a row that stays where it
is (free or finished: it computes garbage into its own cache row at a position inside the cache,
which nothing reads; the scheduler parks rows that stop launching at position 0). A decode step reads
tokens and positions, then `advance` leaves each row's greedy next token (computed in the step) in
`tokens` and moves `positions` on by `active`: inside the step's CUDA graph, so an in-flight step
costs the host one replay and no copies (`EngineRunner.decode_inplace`, `scheduler.Scheduler`).

Imports: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeState:
    tokens: torch.Tensor  # [rows] long
    positions: torch.Tensor  # [rows] long
    active: torch.Tensor  # [rows] long, 0 or 1

    @classmethod
    def zeros(cls, rows: int, device: torch.device) -> DecodeState:
        return cls(*(torch.zeros(rows, dtype=torch.long, device=device) for _ in range(3)))

    def reset(self) -> None:
        for buf in (self.tokens, self.positions, self.active):
            buf.zero_()

    def advance(self, next_tokens: torch.Tensor) -> None:
        """After the step of rows [0, len(next_tokens)): their greedy tokens become the next input, active
        rows move on."""
        bsz = next_tokens.shape[0]
        self.tokens[:bsz].copy_(next_tokens)
        self.positions[:bsz].add_(self.active[:bsz])
