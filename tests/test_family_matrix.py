"""Every decoder-only causal-LM family of the installed transformers, speculated on exactly or refused.

The rows come from transformers itself (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, then the
image-text-to-text families it does not list, on text prompts: `families.py`), so a new release adds
rows. Each family's tiny random model (batch 3, left-padded prompts longer than
any sliding window, greedy) must give plain `generate()`'s tokens with two drafters: the n-gram
drafter (k=4: most drafts rejected) and a draft model that is the target with slightly perturbed
weights (k=3: most drafts accepted), so acceptance and rollback both run on every family; n-gram
draft trees (identical, or refused for sliding windows / recurrent state); and layer_skip (identical,
or refused for a decoder it cannot cut). A family whose padded rows plain `generate()` itself reads
differently from the rows alone must refuse the left-padded batch naming `attention_mask`
(`PADDED_BATCH_REFUSALS`), then pass all of this on prompts of one length. Or it
must be refused before any work with a ValueError naming its model type and the reason listed in
`EXPECTED_REFUSALS`; the refused families are printed at the end of the run (`conftest.py`).
"""

from __future__ import annotations

import re

import families
import pytest
import torch
from conftest import REFUSED_FAMILIES, left_padded_batch, plain_generate, repeated_span_prompts
from test_architectures import perturbed_copy, speculate

# model type -> the reason its refusal must give (a fragment of the ValueError)
EXPECTED_REFUSALS: dict[str, str] = {
    "cpmant": "not all routed through transformers' AttentionInterface",
    "deepseek_v4": "'heavily_compressed_attention'",
    "minimax": "keeps its own cache class",
    "moshi": "cache keeps a sliding window",
    "openai-gpt": "never write a KV cache",
    "prophetnet": "cross-attend",
    "recurrent_gemma": "do not keep the per-token states a rollback needs",
    "reformer": "keeps its own cache class",
    "rwkv": "keeps its own cache class",
    "xlnet": "keeps its own cache class",
    "xlstm": "keeps its own cache class",
    "zamba": "rolling its recurrent state back one token changes its logits",
    "zaya": "rolling its recurrent state back one token changes its logits",
    # image-text-to-text families, on text prompts
    "unlimited_ocr": "'reference_sliding_attention'",
}

# model type -> why it refuses a left-padded batch (plain generate() gives a padded row other tokens than the
# row alone, which the loop gives): these run on prompts of one length instead
PADDED_BATCH_REFUSALS: dict[str, str] = {
    **dict.fromkeys(
        [
            "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "git", "kosmos-2", "kosmos-2.5", "marian", "mbart",
            "mvp", "pegasus", "plbart", "trocr",
        ],
        "left-padded row other logits than the row alone",
    ),  # fmt: skip
    "whisper": "takes no position_ids and left padding changes its logits",
}
# sparse indexed attention (a config with index_topk: DeepSeek-V3.2's kind, GLM-5-Next, Kolibri 1.1, ...): past
# index_topk tokens (16 here, fewer than the padded prompts plus MAX_NEW_TOKENS) left-padded batches are refused
INDEXER_PADDED_BATCH_REFUSAL = r"index_topk=16 keys, and past 16 tokens .* other tokens than the row alone"

# why layer_skip may refuse a family the other drafters run: a decoder that is not one list of
# num_hidden_layers layers
LAYER_SKIP_REFUSALS = (
    "needs one decoder layer per num_hidden_layers|cannot find the decoder layers|not supported on an encoder-decoder target"
)

MAX_NEW_TOKENS = 20


def prompts() -> list[list[int]]:
    """Three prompts of 20, 31 and 40 tokens (longer than the tiny models' windows of 8), ending in
    repeated spans so that n-gram drafts exist."""
    generator = torch.Generator().manual_seed(11)
    out = []
    for length, tail in zip((20, 31, 40), repeated_span_prompts(3, seed=11)):
        head = torch.randint(families.FIRST_FREE_TOKEN_ID, families.VOCAB_SIZE, (max(length - len(tail), 1),), generator=generator)
        out.append(head.tolist() + tail)
    return out


@pytest.mark.parametrize("model_type", families.causal_lm_families() + families.image_text_to_text_families())
def test_family_is_exact_or_refused(model_type):
    if model_type in families.FAMILY_NOTES:  # transformers itself cannot build or plain-generate it here
        try:
            model = families.build_tiny_model(model_type)
        except Exception:  # noqa: BLE001 - whatever transformers raises, the note still holds
            REFUSED_FAMILIES[model_type] = f"not testable here: {families.FAMILY_NOTES[model_type]}"
            return
        # it must not produce tokens either: our refusal, or transformers' own failure before the loop runs
        with pytest.raises(Exception) as error:  # noqa: B017
            speculate(model, left_padded_batch(prompts()), MAX_NEW_TOKENS)
        REFUSED_FAMILIES[model_type] = f"{type(error.value).__name__}; {families.FAMILY_NOTES[model_type]}"
        return
    model = families.build_tiny_model(model_type)
    inputs = left_padded_batch(prompts(), pad_token_id=families.PAD_TOKEN_ID)
    # Kosmos-2's generate() runs its text model (the whole model's forward wants an image): so must its draft
    drafted = model.text_model if model_type == "kosmos-2" else model
    configs = [
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "draft_model", "model": perturbed_copy(drafted), "num_speculative_tokens": 3},
    ]
    if model_type in EXPECTED_REFUSALS:
        with pytest.raises(ValueError, match=rf"model_type='[\w-]+' is not supported: .*{EXPECTED_REFUSALS[model_type]}") as error:
            speculate(model, inputs, MAX_NEW_TOKENS, **configs[0])
        REFUSED_FAMILIES[model_type] = str(error.value).split("is not supported: ", 1)[1]
        return
    padded_refusal = PADDED_BATCH_REFUSALS.get(model_type)
    if getattr(model.config.get_text_config(), "index_topk", None) is not None:
        padded_refusal = INDEXER_PADDED_BATCH_REFUSAL
    if padded_refusal:
        with pytest.raises(ValueError, match=rf"attention_mask: .*{padded_refusal}"):
            speculate(model, inputs, MAX_NEW_TOKENS, **configs[0])
        width = min(len(p) for p in prompts())
        inputs = left_padded_batch([p[-width:] for p in prompts()])  # one length: no padding
    plain = plain_generate(model, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    accepted = rejected = 0
    for config in configs:
        out = speculate(model, inputs, MAX_NEW_TOKENS, **config)
        assert torch.equal(out.sequences, plain), f"{config['method']} differs from plain generate()"
        accepted += out.spec_metrics["num_accepted_tokens"]
        rejected += out.spec_metrics["num_draft_tokens"] - out.spec_metrics["num_accepted_tokens"]
    assert accepted > 0 and rejected > 0, f"accepted {accepted}, rejected {rejected}: the test proves little"
    # layer_skip (the target's first layers on its own cache): exact too, or refused up front with the reason
    early_exit = {"method": "layer_skip", "early_exit_layer": model.config.get_text_config().num_hidden_layers - 1}
    try:
        out = speculate(model, inputs, MAX_NEW_TOKENS, num_speculative_tokens=3, **early_exit)
    except ValueError as error:
        assert re.search(LAYER_SKIP_REFUSALS, str(error)), error
    else:
        assert torch.equal(out.sequences, plain), "layer_skip differs from plain generate()"
        assert out.spec_metrics["num_draft_tokens"] > 0
    # draft trees: exact too, or refused up front with the reason (sliding windows, recurrent state)
    tree = {"method": "ngram", "num_speculative_tokens": 4, "tree": {"num_nodes": 8, "topk": 2}}
    try:
        out = speculate(model, inputs, MAX_NEW_TOKENS, **tree)
    except ValueError as error:
        assert re.search("speculative_config.tree is not supported on (models with|an encoder-decoder target)", str(error)), error
    else:
        assert torch.equal(out.sequences, plain), "ngram trees differ from plain generate()"
