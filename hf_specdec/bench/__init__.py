"""`hf-specdec bench`: plain `generate()`, transformers' own speculation and ours, side by side.

- `prompts.py`: the prompts (MT-bench, HumanEval, or a jsonl file), rendered with the chat template;
- `arms.py`: what each arm passes to `generate()`;
- `runner.py`: the interleaved, timed runs and what they measure;
- `report.py`: the table, the JSON and the speedup-vs-k PNG.

The command line is `hf_specdec/cli.py`.
"""

from .arms import Arm, BenchSettings, build_arms
from .prompts import load_prompts
from .report import format_table, write_json, write_speedup_png
from .runner import run_benchmark

__all__ = [
    "Arm",
    "BenchSettings",
    "build_arms",
    "format_table",
    "load_prompts",
    "run_benchmark",
    "write_json",
    "write_speedup_png",
]
