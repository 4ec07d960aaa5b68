"""What bf16 autocast costs or gains on this CPU: one forward+backward of a model on a batch of tokens, in float32 and
under ``torch.autocast(bfloat16)`` (what ``model.autocast`` does), one thread, median of ``--repeat`` after a warm-up.
Prints the CPU's capability beside the ratio: on CPUs with AMX or AVX512-BF16 bf16 is native and faster; on AVX2-only
CPUs it is emulated and many times slower, which is why ``model.autocast: auto`` picks float32 there.

    .venv/bin/python bench/precision.py [--model smollm2-135m-instruct] [--batch 2] [--tokens 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlworkers.models.loading import load_model, resolve_model_path  # noqa: E402
from rlworkers.workers.common import cpu_bf16_features, native_bf16  # noqa: E402


def step_seconds(model, input_ids: torch.Tensor, dtype: torch.dtype | None) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model.path (tiny, smollm2-135m-instruct)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_model(resolve_model_path(args.model), dtype=torch.float32)
    model.train()
    input_ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens))
    native, why = native_bf16("cpu")
    print(
        f"CPU: torch {torch.backends.cpu.get_cpu_capability()}, {' and '.join(cpu_bf16_features()) or 'no native bf16'}"
    )
    print(f"model.autocast=auto here: {'bfloat16' if native else 'float32'} ({why})")
    times = {}
    for name, dtype in (("float32", None), ("bf16 autocast", torch.bfloat16)):
        step_seconds(model, input_ids, dtype)  # warm-up
        times[name] = statistics.median(step_seconds(model, input_ids, dtype) for _ in range(args.repeat))
        print(
            f"{args.model} forward+backward, {args.batch}x{args.tokens} tokens, 1 thread, {name}: {times[name]:.2f} s"
        )
    print(f"bf16 autocast / float32: {times['bf16 autocast'] / times['float32']:.2f}x the time")


if __name__ == "__main__":
    main()
