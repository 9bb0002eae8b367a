"""Other frameworks' config formats: the plan out (`export`), their configs in (`import`).

One module per format, each a pair of pure functions (plan -> target document, target
document -> job tables) and a `dumps` that writes the document in the format's own syntax.
torchtitan's import half lives in torchtitan_import.py (importable from torchtitan.py too),
and what both of its halves read in torchtitan_common.py.
"""

from __future__ import annotations

TARGETS = ("deepspeed", "torchtitan", "accelerate", "megatron")
