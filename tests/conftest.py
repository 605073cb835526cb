"""Shared fixtures: a tiny random Llama, left-padded batches with repeated spans, a word-level tokenizer.

Everything runs on CPU in fp32. The model is small enough that one thread is fastest (and keeps
runs stable when the machine is busy); the suite runs on two workers (`-n 2`), one thread each:
a test that takes more threads makes both workers' threads contend for the two cores.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

# Triton reads TRITON_INTERPRET when it is imported (transformers' model code imports it), and the
# kernel tests (test_rejection_kernels.py) run Triton's CPU interpreter: set it before that happens.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

torch.set_num_threads(1)

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 1
BOS_TOKEN_ID = 2
FIRST_WORD_ID = 3  # prompts use ids from here on (never pad / eos / bos)

# initializer_range 0.1 with seed 0: greedy output mixes repeated n-grams (drafts get accepted)
# with novel tokens (drafts get rejected), and the top-2 logit gap stays above 1e-3 on every
# step the tests take (fp32 noise between attention paths is ~1e-6).
MODEL_SEED = 0
INITIALIZER_RANGE = 0.1


def build_tiny_llama(
    seed: int = MODEL_SEED, initializer_range: float = INITIALIZER_RANGE, **overrides
) -> LlamaForCausalLM:
    """A 2-layer random Llama in eval mode; `overrides` replace any of its config values."""
    config = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()


# the sampling tests enumerate every continuation of a few tokens: the vocabulary must be tiny
SMALL_VOCAB_SIZE = 16


def build_small_vocab_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 16-token Llama (pad 0, no eos / bos) whose logits spread far from uniform (initializer 0.3)."""
    return build_tiny_llama(
        seed,
        initializer_range=0.3,
        vocab_size=SMALL_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )


def left_padded_batch(prompts: list[list[int]], pad_token_id: int = PAD_TOKEN_ID) -> dict[str, torch.Tensor]:
    """input_ids + attention_mask, each row left-padded to the longest prompt."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def repeated_span_prompts(batch_size: int, seed: int | None = None) -> list[list[int]]:
    """Prompts of different lengths, each a random prefix then a span repeated 2-4 times (then part of it)."""
    rng = random.Random(batch_size if seed is None else seed)
    prompts = []
    for _ in range(batch_size):
        span = [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(rng.randint(3, 6))]
        prefix = [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(rng.randint(0, 4))]
        prompts.append(prefix + span * rng.randint(2, 4) + span[: rng.randint(0, len(span))])
    return prompts


def repeated_span_batch(batch_size: int, seed: int | None = None) -> dict[str, torch.Tensor]:
    return left_padded_batch(repeated_span_prompts(batch_size, seed))


def ngram_config(k: int = 5, lookup_min: int = 1, lookup_max: int = 4, **extra) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": lookup_min,
        "prompt_lookup_max": lookup_max,
        **extra,
    }


# run in the background from the start where the real models are not converted yet (a new machine): the tests that
# read them come late in the run, and a conversion (1.5-2.5 min for Gemma 3) would otherwise run alone at its end;
# a test that needs a model while it is being converted waits on its lock (`real_models._filling`), then reads it
REAL_MODELS_PREFETCH = "from hf_specdec.models import real_models as m; m.smollm2_path(); m.gemma3_path(); m.sharegpt_jsonl()"
REAL_MODEL_FOLDERS = ("SmolLM2-135M-Instruct", "gemma-3-270m")  # (`real_models.smollm2_path`, `gemma3_path`)


def pytest_configure(config):
    from hf_specdec.models import real_models

    cache = real_models.cache_dir()
    ready = all(real_models.is_converted(cache / name) for name in REAL_MODEL_FOLDERS) and (cache / "sharegpt.jsonl").exists()
    if not ready and not hasattr(config, "workerinput"):  # the controller of pytest -n, or the only process
        config.real_model_prefetch = subprocess.Popen(
            [sys.executable, "-c", REAL_MODELS_PREFETCH], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # one thread, beside the workers; quiet (its progress bars): a test that reads a model it failed to make fails itself


def pytest_unconfigure(config):
    prefetch = getattr(config, "real_model_prefetch", None)
    if prefetch is not None:  # not killed: a conversion cut off would leave a half-written model folder
        prefetch.wait()


# model type -> why it is refused, filled by test_family_matrix.py and printed after the run
REFUSED_FAMILIES: dict[str, str] = {}


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its refusals go to the controller, which prints them
        workeroutput["refused_families"] = dict(REFUSED_FAMILIES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    REFUSED_FAMILIES.update(getattr(node, "workeroutput", {}).get("refused_families", {}))


def pytest_terminal_summary(terminalreporter):
    if REFUSED_FAMILIES:
        terminalreporter.section(f"model families refused ({len(REFUSED_FAMILIES)})")
        for model_type, reason in sorted(REFUSED_FAMILIES.items()):
            terminalreporter.write_line(f"{model_type}: {reason}")


def plain_generate(model, **kwargs):
    """transformers' own generate, whether or not hf_specdec.enable() patched the model."""
    original = getattr(model.generate, "_hf_specdec_original", None)
    return (original or model.generate)(**kwargs)


def new_tokens(sequences: torch.Tensor, prompt_width: int) -> torch.Tensor:
    return sequences[:, prompt_width:]


@pytest.fixture
def tiny_llama():
    """A fresh (unpatched) tiny random Llama; identical weights on every call."""
    return build_tiny_llama()


@pytest.fixture
def enabled_llama(tiny_llama):
    import hf_specdec

    return hf_specdec.enable(tiny_llama)


@pytest.fixture(scope="session")
def word_tokenizer():
    """A word-level fast tokenizer over the model's 128 ids: 0 <pad>, 1 </s>, 2 <s>, i -> "w{i}" for 3..126.

    Id 127 is "abcdef": transformers' StopStringCriteria tokenizes that string to learn how tokens
    decode. Tokens decode fused (no spaces), so [5, 17] is "w5w17".
    """
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_TOKEN_ID, "</s>": EOS_TOKEN_ID, "<s>": BOS_TOKEN_ID}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, VOCAB_SIZE - 1)})
    vocab["abcdef"] = VOCAB_SIZE - 1
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        padding_side="left",
    )
    assert len(tokenizer) == VOCAB_SIZE
    return tokenizer


def load_benchmark(name: str):
    """`benchmarks/<name>.py` imported as a module (registered in sys.modules: dataclasses look it up)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_launcher(command: list[str], timeout: float, **env: str) -> str:
    """Run a multi-process launcher (torchrun, accelerate launch) in its own session, with `env` over
    ours; its output. AssertionError with the output's end when it fails or outlives `timeout` (then
    the launcher and every process it started are killed: a process waiting on a collective that
    another never joins would wait forever)."""
    process = subprocess.Popen(
        command, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{command[2]} did not finish in {timeout} s:\n{output[-5000:]}") from None
    assert process.returncode == 0, output[-5000:]
    return output
