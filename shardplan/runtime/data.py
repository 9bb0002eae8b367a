"""Training tokens: a deterministic synthetic stream a model can learn, or a flat binary file.

Sample j of the run (global index step * global_batch + position) is a function of the seed
and j alone, so every layout that splits the same global batch sees the same sequences: the
single-process reference and a dp x tp x pp run train on identical data.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..spec.errors import InputError, Problem
from . import token_file

# Synthetic sequences are arithmetic progressions modulo the vocabulary: token k is
# start + stride * k. After two tokens the rest is predictable, so the loss falls.
MAX_STRIDE = 7


@dataclass(frozen=True)
class Batching:
    """How a step's global batch is cut: dp ranks x microbatches x micro_batch_size."""

    dp: int
    micro_batch: int
    microbatches: int
    seq_len: int

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.microbatches

    def indices(self, step: int, microbatch: int, dp_rank: int) -> range:
        """Global sample indices of one rank's microbatch: microbatch i of every rank
        together is the i-th slice of the global batch (the reference's microbatch i)."""
        start = step * self.global_batch + (microbatch * self.dp + dp_rank) * self.micro_batch
        return range(start, start + self.micro_batch)


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab, self.seq_len, self.seed = vocab_size, seq_len, seed

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab, (1,), generator=generator))
        stride = int(torch.randint(1, MAX_STRIDE + 1, (1,), generator=generator))
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab


class FileTokens:
    """A flat file of token ids (uint16 or uint32), memory-mapped; windows at random offsets.
    A file that cannot serve is bad input (exit 2), here as in the launcher's check before
    torchrun starts (runtime/token_file.py)."""

    def __init__(self, path: str, dtype: str, vocab_size: int, seq_len: int, seed: int):
        self.vocab, self.seq_len, self.seed = vocab_size, seq_len, seed
        dtype = token_file.token_dtype(dtype, vocab_size)
        self.width = token_file.WIDTHS[dtype]
        problem = token_file.kind_problem(path, path)
        if problem:
            raise InputError(Problem("data.path", problem))
        try:
            with Path(path).open("rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                problem = token_file.size_problem(path, size, dtype, seq_len)
                if problem:
                    raise InputError(Problem("data.path", problem))
                self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)  # stays open without the handle
        except OSError as exc:
            raise InputError(Problem("data.path", f"{path}: cannot read: {exc.strerror or exc}")) from None
        self.count = size // self.width
        storage = torch.int16 if self.width == 2 else torch.int32
        self.tokens = torch.frombuffer(self.map, dtype=storage)
        self.mask = 0xFFFF if self.width == 2 else 0xFFFFFFFF
        self.path = path

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        offset = int(torch.randint(self.count - self.seq_len, (1,), generator=generator))
        window = self.tokens[offset:offset + self.seq_len + 1].to(torch.int64) & self.mask
        if int(window.max()) >= self.vocab:
            first = int(torch.nonzero(window >= self.vocab)[0])
            raise InputError(Problem("data.path", token_file.vocabulary_problem(
                self.path, int(window[first]), offset + first, self.vocab)))
        return window


def batch(source, indices: range, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of shape (len(indices), seq_len): targets are tokens shifted by one."""
    rows = torch.stack([source.sample(i) for i in indices])
    return rows[:, :-1].to(device), rows[:, 1:].to(device)
