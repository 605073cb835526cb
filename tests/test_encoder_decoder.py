"""Encoder-decoder models (BART, T5, Marian, Pegasus, Whisper, Moonshine, ...): every family transformers maps to a
sequence-to-sequence or speech-to-text class, speculated on exactly or refused.

The rows come from transformers itself (`families.encoder_decoder_families`), so a new release adds rows. Each
family's tiny random model gets a batch of two sources (the second padded, as a tokenizer or feature extractor
pads it) and must give plain `generate()`'s tokens with the n-gram drafter and with an encoder-decoder draft
model (the target with slightly perturbed weights, which runs its own encoder on the same sources), accepting
and rejecting drafts; or be refused before any work with a ValueError naming its model type and the reason in
`EXPECTED_REFUSALS`. Sampling follows plain `generate()`'s distribution (chi-square), and fails when the
decoder reads the padding of its source.
"""

from __future__ import annotations

import itertools

import families
import numpy as np
import pytest
import torch
import transformers
from conftest import REFUSED_FAMILIES, SMALL_VOCAB_SIZE, plain_generate
from test_architectures import perturbed_copy, speculate
from test_sampling_distribution import NEW_TOKENS, PROMPT, SETTINGS, chi_square_pvalue
from transformers import LogitsProcessor, LogitsProcessorList

import hf_specdec
from hf_specdec.cache import own_attention
from hf_specdec.cache.architectures import check_architecture, padding_ends_forward
from hf_specdec.cache.own_attention import (
    EncoderDecoderBatchedCache,
    EncoderDecoderRowCache,
    mark_own_attention,
    runs_one_row_per_forward,
)
from hf_specdec.drafters.ngram import NgramProposer
from hf_specdec.loop import encoder_decoder
from hf_specdec.loop import engine as engine_module
from hf_specdec.loop import step as loop_step

# model type -> the reason its refusal must give (a fragment of the ValueError)
EXPECTED_REFUSALS = {
    # its decoder counts positions from the tokens it is fed, not from its cache: several new tokens at once
    # (a verify) read other positions than one at a time
    "fsmt": "logits on its own cache differ from its own forward",
    "prophetnet": "use_cache` is only supported for `decoder_input_ids` of length 1",
}
# model type -> why it cannot be tried here (transformers itself cannot build or plain-generate it from a source)
NOT_TESTABLE = {
    "dia": "text-to-speech over audio codebooks: plain generate() fails on text input_ids alone",
    "pop2piano": "its own generate() wants input_features of a piano transcription processor",
    "moonshine_streaming": "the tiny config does not build (MoonshineStreamingConfig has no num_key_value_heads)",
}
MAX_NEW_TOKENS = 20


def source_inputs(model, batch: int = 2) -> dict:
    """A batch of random sources for the model's encoder, the last row padded (its mask ends in zeros): token
    ids with repeated spans (n-gram drafts find matches in the decoder's output only, which echoes them), audio
    samples, or spectrogram frames."""
    generator = torch.Generator().manual_seed(0)
    name, config = model.main_input_name, model.config
    if name == "input_ids":
        span = torch.randint(families.FIRST_FREE_TOKEN_ID, families.VOCAB_SIZE, (batch, 4), generator=generator)
        source = torch.cat([span, span, span[:, :2]], dim=1)
        mask = torch.ones_like(source)
        source[-1, 7:], mask[-1, 7:] = families.PAD_TOKEN_ID, 0
        return {"input_ids": source, "attention_mask": mask}
    if name in ("inputs", "input_values"):  # raw audio
        mask = torch.ones((batch, 4000), dtype=torch.long)
        mask[-1, 3000:] = 0
        return {name: torch.randn((batch, 4000), generator=generator), "attention_mask": mask}
    if config.model_type == "whisper":  # 30 s of log-mel frames, never padded
        return {"input_features": torch.randn((batch, config.num_mel_bins, 2 * config.max_source_positions), generator=generator)}
    encoder_config = model.get_encoder().config  # (Canary's Parakeet encoder has a config of its own)
    features = getattr(encoder_config, "num_mel_bins", None) or config.input_feat_per_channel * config.input_channels
    mask = torch.ones((batch, 80), dtype=torch.long)
    mask[-1, 60:] = 0
    return {"input_features": torch.randn((batch, 80, features), generator=generator), "attention_mask": mask}


@pytest.mark.parametrize("model_type", families.encoder_decoder_families())
def test_encoder_decoder_family_is_exact_or_refused(model_type):
    if model_type in NOT_TESTABLE:
        with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises, the note holds
            model = families.build_tiny_encoder_decoder(model_type)
            plain_generate(model, **source_inputs(model), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        REFUSED_FAMILIES[model_type] = f"not testable here: {NOT_TESTABLE[model_type]}"
        return
    model = families.build_tiny_encoder_decoder(model_type)
    inputs = {**source_inputs(model), "num_beams": 1}  # (FSMT's generation config asks for beams)
    if model_type in EXPECTED_REFUSALS:
        with pytest.raises(ValueError, match=rf"model_type='[\w-]+' is not supported: .*{EXPECTED_REFUSALS[model_type]}") as error:
            speculate(model, inputs, MAX_NEW_TOKENS)
        REFUSED_FAMILIES[model_type] = str(error.value).split("is not supported: ", 1)[1]
        return
    # as `speculate` asks (Whisper's own generate() returns its dict's sequences without the start token)
    plain = plain_generate(model, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    plain = plain.sequences
    accepted = rejected = 0
    for config in (
        {"method": "ngram", "num_speculative_tokens": 3},
        # a draft that mostly agrees, and one of other random weights that mostly does not
        {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3},
        {"method": "draft_model", "model": families.build_tiny_encoder_decoder(model_type, seed=1), "num_speculative_tokens": 2},
    ):
        model.__dict__.pop("spec_decode_metrics", None)  # (Whisper's own generate() rebuilds the output without them)
        out = speculate(model, inputs, MAX_NEW_TOKENS, **config)
        assert torch.equal(out.sequences, plain), f"{config['method']} differs from plain generate()"
        metrics = model.spec_decode_metrics
        accepted += metrics.num_accepted_tokens
        rejected += metrics.num_draft_tokens - metrics.num_accepted_tokens
    assert accepted > 0 and rejected > 0, f"accepted {accepted}, rejected {rejected}: the test proves little"


@pytest.mark.parametrize("model_type", ["t5", "whisper", "bart", "t5gemma"])
def test_rows_batched_where_the_decoder_reads_their_own_positions(model_type):
    """Every row in one forward (`EncoderDecoderBatchedCache`) where the decoder reads each row's own positions:
    handed over (Whisper's decoder_position_ids), as differences only (T5's relative bias), or its
    `embed_positions` evaluated again at each row's own length (BART). Rows accept different numbers of drafts
    (realigned between forwards) and finish at different steps (the batch shrinks from its end, the slots'
    encoder output and cross-attention keys with it), and give plain generate()'s tokens. T5Gemma's sliding
    layers cannot be realigned: one row per forward."""
    model = families.build_tiny_encoder_decoder(model_type)
    # each row's decoder starts with a tag of its own; the processor ends row r after 15 - 3 r tokens: the last
    # row first, so the batch shrinks from its end (Whisper's own generate() would rewrite these decoder ids)
    decoder_ids = torch.tensor([[families.BOS_TOKEN_ID, 10 + row] for row in range(4)])
    eos = model.generation_config.eos_token_id
    inputs = {
        **source_inputs(model, batch=4), "decoder_input_ids": decoder_ids, "max_new_tokens": 16, "do_sample": False,
        "logits_processor": LogitsProcessorList([_EndRows({10 + row: 6 + 3 * (3 - row) for row in range(4)}, eos)]),
    }  # fmt: skip
    plain = transformers.GenerationMixin.generate(model, **inputs)
    assert [row.tolist().index(eos) for row in plain] == [15, 12, 9, 6]
    draft = {"method": "draft_model", "model": perturbed_copy(model, scale=0.05), "num_speculative_tokens": 3}
    check_architecture(model)  # (its probe's forwards before the hook)
    widths = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    out = transformers.GenerationMixin.generate(model, **inputs, custom_generate=hf_specdec.generate, speculative_config=draft)
    hook.remove()
    assert torch.equal(out, plain)
    metrics = model.spec_decode_metrics
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    if model_type == "t5gemma":
        assert set(widths) == {1}
    else:  # one forward for all four rows, then fewer as the last ones finish
        assert widths[0] == 4 and widths[-1] < 4 and len(widths) < 16, widths


class _EndRows(LogitsProcessor):
    """Ends each row (told apart by its second decoder token) with `eos` once it holds `lengths[tag]` tokens, and
    not before."""

    def __init__(self, lengths: dict[int, int], eos: int):
        self.lengths, self.eos = lengths, eos

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for index, row in enumerate(input_ids):
            ends = row.shape[0] >= self.lengths[int(row[1])]
            if ends:
                scores[index] = -torch.inf
            scores[index, self.eos] = 0.0 if ends else -torch.inf
        return scores


def test_padding_id_ends_a_forward_where_the_decoder_numbers_tokens_by_it(monkeypatch):
    """M2M-100 (NLLB-MoE, SpeechT5 alike) numbers a forward's tokens by counting those that are not the padding
    id (fairseq's positions), and plain generate() feeds it one token at a time. Where the padding id is generated
    (forced here at the fifth token), the loop feeds nothing after it in the same forward, and a draft that is the
    padding id ends its row's drafts: plain generate()'s tokens and scores. With drafts fed after it, the scores
    after it differ (a random decoder's tokens hardly do)."""
    model = families.build_tiny_encoder_decoder("m2m_100")
    bart = families.build_tiny_encoder_decoder("bart")
    check_architecture(model), check_architecture(bart)
    assert padding_ends_forward(model) == families.PAD_TOKEN_ID and padding_ends_forward(bart) is None
    inputs = {
        **source_inputs(model), "max_new_tokens": 16, "do_sample": False, "output_scores": True,
        "return_dict_in_generate": True, "logits_processor": LogitsProcessorList([_ForceAt(5, families.PAD_TOKEN_ID)]),
    }  # fmt: skip
    plain = transformers.GenerationMixin.generate(model, **inputs)
    assert (plain.sequences[:, 5] == families.PAD_TOKEN_ID).all() and (plain.sequences != families.EOS_TOKEN_ID).all()
    draft = {"method": "draft_model", "model": perturbed_copy(model, scale=0.05), "num_speculative_tokens": 3}

    def same_as_plain() -> bool:
        out = transformers.GenerationMixin.generate(model, **inputs, custom_generate=hf_specdec.generate, speculative_config=draft)
        scores, plain_scores = torch.stack(out.scores), torch.stack(plain.scores)
        finite = torch.isfinite(plain_scores)
        return torch.equal(out.sequences, plain.sequences) and torch.allclose(scores[finite], plain_scores[finite], atol=1e-4)

    assert same_as_plain() and model.spec_decode_metrics.num_accepted_tokens > 0
    monkeypatch.setattr(loop_step, "padding_ends_forward", lambda model: None)
    assert not same_as_plain()


class _ForceAt(LogitsProcessor):
    """Makes every row pick `token` as its decoder's `length`-th token (input_ids of that length)."""

    def __init__(self, length: int, token: int):
        self.length, self.token = length, token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] != self.length:
            return scores
        forced = torch.full_like(scores, -torch.inf)
        forced[:, self.token] = 0.0
        return forced


def test_whisper_through_its_own_generate_with_a_distilled_style_assistant():
    """Whisper's generate() (its own, which wraps transformers') with `hf_specdec.enable`, drafted by a smaller
    Whisper (the distil-whisper pairing: fewer decoder layers, the same tokenizer) that runs its own encoder;
    rows decoded to different lengths (an eos); with timestamps (Whisper's timestamp logits processor)."""
    model = hf_specdec.enable(families.build_tiny_encoder_decoder("whisper"))
    config = model.config.to_dict() | {"decoder_layers": 1}
    draft = type(model)(type(model.config).from_dict(config)).eval()
    draft.generation_config = model.generation_config
    inputs = source_inputs(model, batch=3)
    plain = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False)
    out = model.generate(
        **inputs, max_new_tokens=24, do_sample=False,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
    )  # fmt: skip
    assert torch.equal(out, plain)
    assert model.spec_decode_metrics.num_draft_tokens > 0
    model.generation_config.no_timestamps_token_id = 100  # timestamp tokens: 101.. in the tiny vocabulary
    model.generation_config.max_initial_timestamp_index = 5
    plain = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False, return_timestamps=True)
    out = model.generate(
        **inputs, max_new_tokens=24, do_sample=False, return_timestamps=True,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
    )  # fmt: skip
    assert torch.equal(out, plain) and (plain > 100).any(), "no timestamp tokens: the test would prove little"
    # long-form: 75 s of frames (one row 51 s), which Whisper's generate() decodes 30 s at a time, each segment
    # after the text of the one before
    frames = 2 * model.config.max_source_positions * 5 // 2
    mask = torch.ones((2, frames), dtype=torch.long)
    mask[1, frames * 17 // 25 :] = 0
    long_form = {
        "input_features": torch.randn((2, model.config.num_mel_bins, frames), generator=torch.Generator().manual_seed(1)),
        "attention_mask": mask, "return_timestamps": True, "condition_on_prev_tokens": True, "max_new_tokens": 20,
        "do_sample": False,
    }  # fmt: skip
    plain = plain_generate(model, **long_form)
    out = model.generate(**long_form, speculative_config={"method": "ngram"})
    assert torch.equal(out, plain) and plain.shape[1] > 40, "one segment: the test would prove little"
    with pytest.raises(ValueError, match="decoder_position_ids is not supported"):
        model.generate(
            **inputs, decoder_input_ids=torch.full((3, 2), families.BOS_TOKEN_ID), max_new_tokens=4,
            decoder_position_ids=torch.tensor([[3, 4]] * 3), speculative_config={"method": "ngram"},
        )  # fmt: skip


def test_image_to_text_encoder_decoder():
    """A vision encoder-decoder (a ViT encoder, a TrOCR decoder cross-attending to it: TrOCR's, Donut's layout)
    from pixel values: the probe, which cannot make images up, checks the decoder on random encoder states."""
    vit = families.tiny_config_of("vit", image_size=32, patch_size=8)
    decoder = families.tiny_config("trocr")
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, decoder)
    torch.manual_seed(0)
    model = hf_specdec.enable(transformers.VisionEncoderDecoderModel(config).eval())
    model.config.decoder_start_token_id, model.config.pad_token_id = families.BOS_TOKEN_ID, families.PAD_TOKEN_ID
    generation = model.generation_config
    generation.decoder_start_token_id, generation.pad_token_id = families.BOS_TOKEN_ID, families.PAD_TOKEN_ID
    generation.eos_token_id = families.EOS_TOKEN_ID
    pixels = torch.randn((2, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    plain = plain_generate(model, pixel_values=pixels, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    for config in ({"method": "ngram"}, {"method": "draft_model", "model": perturbed_copy(model)}):
        model.__dict__.pop("spec_decode_metrics", None)
        out = model.generate(pixel_values=pixels, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, speculative_config=config)
        assert torch.equal(out, plain), f"{config['method']} differs from plain generate()"
    assert model.spec_decode_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("model_type", ["t5", "bart"])
def test_processors_reading_each_rows_source(model_type):
    """encoder_repetition_penalty and encoder_no_repeat_ngram_size hold one source per batch row: each verified
    position reads its own row's (at batch 3 a prefix-length group holds one or two rows), as plain generate()."""
    model = families.build_tiny_encoder_decoder(model_type)
    inputs = {**source_inputs(model, batch=3), "num_beams": 1}
    options = {"encoder_repetition_penalty": 10.0, "encoder_no_repeat_ngram_size": 2}
    baseline = plain_generate(model, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    plain = plain_generate(model, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **options)
    assert (plain != baseline).any(dim=1).all(), "the options leave a row as it was: the test proves little"
    out = model.generate(
        **inputs, **options, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, custom_generate=hf_specdec.generate,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert torch.equal(out, plain)
    assert model.spec_decode_metrics.num_accepted_tokens > 0


def test_suffix_scores_streamer_and_n_gram_first_on_an_encoder_decoder():
    """What composes on an encoder-decoder target as on a decoder-only one: the suffix drafter, output_scores,
    a streamer (batch 1: it gets the decoder's tokens), and an n-gram lookup in front of an encoder-decoder draft."""
    model = hf_specdec.enable(families.build_tiny_encoder_decoder("bart"))
    inputs = source_inputs(model)
    options = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_scores=True)
    plain = plain_generate(model, **inputs, **options)
    for config in (
        {"method": "suffix", "num_speculative_tokens": 4},
        {"method": "draft_model", "model": perturbed_copy(model), "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    ):
        out = model.generate(**inputs, **options, speculative_config=config)
        assert torch.equal(out.sequences, plain.sequences), config["method"]
        assert isinstance(out, transformers.generation.utils.GenerateEncoderDecoderOutput)
        assert out.spec_metrics["num_draft_tokens"] > 0
        new = plain.sequences[:, 1:]  # the scores of a row's steps up to its eos (after it: plain's pad steps, our 0s)
        alive = (new == families.EOS_TOKEN_ID).long().cumsum(dim=1) - (new == families.EOS_TOKEN_ID).long() == 0
        for step, (ours, theirs) in enumerate(zip(out.scores, plain.scores)):
            ours, theirs = ours[alive[:, step]], theirs[alive[:, step]]
            finite = torch.isfinite(theirs)
            # (fp32: a row alone, several tokens per forward, against the batch one token at a time)
            assert torch.equal(finite, torch.isfinite(ours)) and torch.allclose(ours[finite], theirs[finite], atol=1e-3)
    streamer = transformers.generation.streamers.BaseStreamer()
    streamed = []
    streamer.put, streamer.end = lambda tokens: streamed.extend(tokens.flatten().tolist()), lambda: None
    one = {name: value[:1] for name, value in inputs.items()}
    out = model.generate(**one, max_new_tokens=MAX_NEW_TOKENS, streamer=streamer, speculative_config={"method": "ngram"})
    assert streamed == out[0].tolist()


class _CopySource(LogitsProcessor):
    """Makes a batch-1 decoder copy `source` token by token after its start token (a summary quoting its text)."""

    def __init__(self, source: list[int]):
        self.source = source

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, -torch.inf)
        forced[:, self.source[min(input_ids.shape[1] - 1, len(self.source) - 1)]] = 0.0
        return forced


def test_n_gram_lookup_searches_the_source(monkeypatch):
    """On an encoder-decoder model sharing one vocabulary (BART), the n-gram drafter looks the row's last tokens
    up in its source too: a decoder made to copy its source accepts drafts from the second token on, where its
    own tokens alone give none until a span repeats. Whisper's source is audio: nothing to look up."""
    config = families.tiny_encoder_decoder_config("bart")
    config.tie_word_embeddings = True  # as in BART's checkpoints: one embedding for the encoder and the decoder
    model = hf_specdec.enable(families.build_tiny_encoder_decoder("bart", config=config))
    source = [5, 9, 14, 22, 31, 40, 51, 60, 72, 80, 91, 99, 105, 110]
    inputs = {"input_ids": torch.tensor([source]), "logits_processor": LogitsProcessorList([_CopySource(source)])}
    plain = plain_generate(model, **inputs, max_new_tokens=len(source), do_sample=False)
    assert plain[0, 1:].tolist() == source
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    accepted = []
    for with_source in (True, False):
        if not with_source:
            monkeypatch.setattr(NgramProposer, "set_source", lambda self, row, tokens: None)
        model.__dict__.pop("spec_decode_metrics", None)
        out = model.generate(**inputs, max_new_tokens=len(source), do_sample=False, speculative_config=config)
        assert torch.equal(out, plain)
        accepted.append(model.spec_decode_metrics.num_accepted_tokens)
    assert accepted[0] >= len(source) // 2 and accepted[1] == 0, accepted
    # (a padded row's padding is not part of its source)
    padded = encoder_decoder.source_tokens(model, torch.tensor([source + [0, 0]]), torch.tensor([[1] * len(source) + [0, 0]]))
    assert [row.tolist() for row in padded] == [source]
    whisper = families.build_tiny_encoder_decoder("whisper")
    assert encoder_decoder.source_tokens(whisper, source_inputs(whisper)["input_features"], None) == []
    # mT5's checkpoints hold one embedding that transformers loads into two tensors: equal values count as shared
    mt5 = families.build_tiny_encoder_decoder("mt5")
    assert encoder_decoder.source_tokens(mt5, torch.tensor([source]), None) == []  # (random: two vocabularies)
    mt5 = families.build_tiny_encoder_decoder("mt5")
    with torch.no_grad():
        mt5.get_decoder().get_input_embeddings().weight.copy_(mt5.get_encoder().get_input_embeddings().weight)
    assert [row.tolist() for row in encoder_decoder.source_tokens(mt5, torch.tensor([source]), None)] == [source]


def test_each_source_sampled_several_times(monkeypatch):
    """num_return_sequences: generate() repeats each row's encoder output; the draft's source and the n-gram
    lookup's follow (row i of the output reads source i // n), and seeded runs reproduce."""
    config = families.tiny_encoder_decoder_config("bart")
    config.tie_word_embeddings = True
    model = hf_specdec.enable(families.build_tiny_encoder_decoder("bart", config=config))
    inputs = source_inputs(model)
    seen = {}
    set_source = NgramProposer.set_source

    def noted(self, row, tokens):
        seen[row] = tokens.tolist()
        set_source(self, row, tokens)

    monkeypatch.setattr(NgramProposer, "set_source", noted)
    options = dict(max_new_tokens=8, do_sample=True, num_return_sequences=3, temperature=1.5)
    speculative = {"method": "draft_model", "model": perturbed_copy(model), "prompt_lookup_min": 1, "seed": 5}
    first = model.generate(**inputs, **options, speculative_config=speculative)
    again = model.generate(**inputs, **options, speculative_config=speculative)
    assert first.shape[0] == 6 and torch.equal(first, again)
    kept = inputs["attention_mask"].bool()
    assert seen == {row: inputs["input_ids"][row // 3][kept[row // 3]].tolist() for row in range(6)}


@pytest.mark.parametrize(
    ("config", "kwargs", "message"),
    [
        ({"method": "layer_skip", "early_exit_layer": 1}, {}, "method='layer_skip' is not supported on an encoder-decoder"),
        ({"method": "ngram", "tree": {"num_nodes": 6, "topk": 2}}, {}, "tree is not supported on an encoder-decoder"),
        ({"method": "ngram"}, {"decoder_attention_mask": torch.tensor([[0, 1], [1, 1]])}, "decoder_attention_mask is not supported"),
    ],
)
def test_what_an_encoder_decoder_target_cannot_take_is_refused(config, kwargs, message):
    model = hf_specdec.enable(families.build_tiny_encoder_decoder("bart"))
    inputs = source_inputs(model)
    if kwargs:
        inputs["decoder_input_ids"] = torch.full((2, 2), families.BOS_TOKEN_ID)
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs, **kwargs, max_new_tokens=4, speculative_config=config)


def test_draft_model_needs_the_source_and_an_encoder_decoder_draft():
    model = hf_specdec.enable(families.build_tiny_encoder_decoder("bart"))
    inputs = source_inputs(model)
    with torch.no_grad():
        encoded = model.get_encoder()(**inputs)
    config = {"method": "draft_model", "model": perturbed_copy(model)}
    with pytest.raises(ValueError, match="needs the encoder's inputs"):
        model.generate(encoder_outputs=encoded, attention_mask=inputs["attention_mask"], max_new_tokens=4, speculative_config=config)
    # the n-gram drafter reads the decoder's tokens only: encoder_outputs alone are enough
    plain = plain_generate(model, encoder_outputs=encoded, attention_mask=inputs["attention_mask"], max_new_tokens=8)
    ours = model.generate(encoder_outputs=encoded, attention_mask=inputs["attention_mask"], max_new_tokens=8, speculative_config={"method": "ngram"})
    assert torch.equal(ours, plain)
    decoder_only = families.build_tiny_model("llama")
    with pytest.raises(ValueError, match="the draft is a decoder-only model and the target an encoder-decoder model"):
        model.generate(**inputs, max_new_tokens=4, speculative_config={"method": "draft_model", "model": decoder_only})
    # the engine: each request brings its source; drafters that read a decoder-only target's states are refused
    with pytest.raises(ValueError, match="method='layer_skip' is not supported on an encoder-decoder target"):
        hf_specdec.SpeculativeEngine(model, {"method": "layer_skip", "early_exit_layer": 1, "num_speculative_tokens": 2})
    engine = hf_specdec.SpeculativeEngine(model, {"method": "ngram"})
    with pytest.raises(ValueError, match=r"model_inputs: BartForConditionalGeneration is an encoder-decoder model; a request needs its source"):
        engine.add_request([2], {"max_new_tokens": 4})
    with pytest.raises(ValueError, match=r"model_inputs\['input_ids'\] must be a batch of one source"):
        engine.add_request([2], {"max_new_tokens": 4}, model_inputs={"input_ids": inputs["input_ids"]})
    with pytest.raises(ValueError, match=r"model_inputs\['input_ids'\] must be a \[1, length\] tensor of token ids in \[0, "):
        engine.add_request([2], {"max_new_tokens": 4}, model_inputs={"input_ids": inputs["input_ids"][:1] + 10**6})


def sources_of_their_own(model, count: int) -> list[dict]:
    """`count` sources as requests bring them, each a batch of one, of lengths that differ (a row of
    `source_inputs` cut to its own length)."""
    name, batch = model.main_input_name, source_inputs(model, batch=count)
    sources = []
    for row in range(count):
        if "attention_mask" not in batch:  # Whisper's 30 s
            sources.append({name: batch[name][row : row + 1]})
            continue
        length = int(batch["attention_mask"][row].sum()) - row
        values = batch[name][row : row + 1]
        sources.append({name: values[..., :length] if values.ndim == 2 else values[:, :length], "attention_mask": torch.ones((1, length), dtype=torch.long)})
    return sources


@pytest.mark.parametrize(("model_type", "batched"), [("t5", True), ("bart", True), ("speech_to_text", True), ("t5gemma", False)])
def test_engine_requests_bring_their_sources_and_join_mid_flight(monkeypatch, model_type, batched):
    """Each request gives its own source (of its own length): the engine runs the encoder on it as it joins, and
    the decoder reads it padded to the longest in one forward (batched) or alone (a row per forward); every
    request gets what plain generate() gives its source alone, finishing apart, rows reused, the pool empty.
    Batched, a joining row's cross-attention keys are computed for it alone, beside the kept keys of the row
    that stays (the layout as wide, then narrower: the longest source finished)."""
    joined_alone = []
    computed_alone = EncoderDecoderBatchedCache._joining_keys
    monkeypatch.setattr(
        EncoderDecoderBatchedCache, "_joining_keys", lambda cache, slots: joined_alone.append(len(slots)) or computed_alone(cache, slots)
    )
    model = families.build_tiny_encoder_decoder(model_type)
    sources = sources_of_their_own(model, 5)
    start = [model.generation_config.decoder_start_token_id]
    lengths = [12, 6, 10, 8, 12]
    plain = [
        plain_generate(model, **source, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, 1:].tolist()
        for source, n in zip(sources, lengths)
    ]  # fmt: skip
    accepted = rejected = 0
    for config in ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3}):
        engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=2)
        assert isinstance(engine.cache, EncoderDecoderBatchedCache if batched else EncoderDecoderRowCache)

        def add(index, engine=engine):
            options = {"max_new_tokens": lengths[index], "min_new_tokens": lengths[index], "do_sample": False}
            return engine.add_request(start, options, model_inputs=sources[index])

        ids, outputs, steps = [add(0), add(1)], {}, 0
        while engine.has_unfinished():
            for output in engine.step():
                assert output.finish_reason != "error", output.error
                if output.finished:
                    outputs[output.request_id] = output.token_ids
            steps += 1
            if steps == 2:  # three more join while the first two run: they wait for rows
                ids += [add(2), add(3), add(4)]
        assert [outputs[i] for i in ids] == plain, f"{config['method']}: differs from plain generate() on each source alone"
        assert engine.num_kv_blocks_used == 0
        # requests 2, 3 and 4 join beside a running row (the target's cache; a draft model's too)
        assert (len(joined_alone) >= 3 and set(joined_alone) == {1}) if batched else not joined_alone
        joined_alone.clear()
        accepted += engine.metrics.num_accepted_tokens
        rejected += engine.metrics.num_draft_tokens - engine.metrics.num_accepted_tokens
    assert accepted > 0 and rejected > 0, f"accepted {accepted}, rejected {rejected}: the test proves little"


@pytest.mark.parametrize(
    ("model_type", "cache_class"),
    [("bart", EncoderDecoderBatchedCache), ("bart", EncoderDecoderRowCache), ("t5", EncoderDecoderBatchedCache)],
)
def test_sampling_matches_exact_distribution_and_fails_reading_the_source_padding(monkeypatch, model_type, cache_class):
    """A 16-token BART (every row in one forward, and made to run one row per forward) and T5 (every row in one)
    on a source padded at its end; P(3 new tokens) enumerated from plain generate()'s processed scores after each
    decoder prefix. Broken: the decoder's cross-attention reads the padding (the encoder mask dropped), which must
    fail the same test."""
    config = families.tiny_encoder_decoder_config(model_type, init_scale=1.0)
    config.vocab_size = SMALL_VOCAB_SIZE
    model = families.build_tiny_encoder_decoder(model_type, config=config)
    check_architecture(model)
    mark_own_attention(model, batched=cache_class is EncoderDecoderBatchedCache)
    model.generation_config.eos_token_id = None
    model = hf_specdec.enable(model)
    # 8 padding tokens: T5 read 3 little (the broken run's p = 8.7e-4 at 2000 samples, against 6.4e-17 with 8)
    source = torch.tensor([PROMPT + [0] * 8])
    mask = torch.tensor([[1] * len(PROMPT) + [0] * 8])
    start = families.BOS_TOKEN_ID  # the decoder's start
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_decoder_distribution(model, source, mask, start, sampling)
    assert max(exact.values()) < 0.5, "the distribution is nearly deterministic: the test would prove little"
    draft = {"method": "draft_model", "model": perturbed_copy(model, scale=0.3), "num_speculative_tokens": 2}

    def samples(count: int) -> torch.Tensor:
        rows, out = 500, []
        for call in range(count // rows):
            sequences = model.generate(
                input_ids=source.repeat(rows, 1), attention_mask=mask.repeat(rows, 1), max_new_tokens=NEW_TOKENS,
                do_sample=True, **sampling, speculative_config={**draft, "seed": 7 + call * rows},
            )  # fmt: skip
            assert model.spec_decode_metrics.num_draft_tokens > model.spec_decode_metrics.num_accepted_tokens > 0
            out.append(sequences[:, 1:].numpy())
        return np.concatenate(out)

    assert chi_square_pvalue(samples(2000), exact) > 1e-3
    assert runs_one_row_per_forward(model) == (cache_class is EncoderDecoderRowCache)
    set_states = cache_class.set_encoder_states
    monkeypatch.setattr(cache_class, "set_encoder_states", lambda self, rows, out, mask: set_states(self, rows, out, None))
    # measured broken (3 padding tokens then): BART p = 0.0 at 500 samples (both caches); T5 (8) 6.4e-17 at 2000
    assert chi_square_pvalue(samples(500 if model_type == "bart" else 2000), exact) < 1e-3


@pytest.mark.parametrize("model_type", ["t5", "speech_to_text", "t5gemma"])
def test_engine_sources_joining_together_run_the_encoder_once(monkeypatch, model_type):
    """Requests whose sources have one shape, joining in one step, go through the encoder in one batch (the
    target's encoder and a draft model's); each gets what plain generate() gives its source alone, the decoder
    batched (T5, Speech2Text: the last source's mask ends in zeros) or a row per forward (T5Gemma)."""
    model = families.build_tiny_encoder_decoder(model_type)
    batch = source_inputs(model, batch=4)
    width = 7 if "input_ids" in batch else None  # the token sources' unpadded part
    sources = [{name: values[row : row + 1, :width] for name, values in batch.items()} for row in range(4)]
    start = [model.generation_config.decoder_start_token_id]
    greedy = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False}
    plain = [plain_generate(model, **source, **greedy)[0, 1:].tolist() for source in sources]
    configs = ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3})
    encoded = []
    for encoder_decoder_model in (model, configs[1]["model"]):
        encode = encoder_decoder_model._maybe_prepare_encoder_kwargs_for_generation
        monkeypatch.setattr(
            encoder_decoder_model, "_maybe_prepare_encoder_kwargs_for_generation",
            lambda source, *a, encode=encode: encoded.append(len(source)) or encode(source, *a),
        )  # fmt: skip
    for config in configs:
        encoded.clear()
        engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=4)
        ids = [engine.add_request(start, greedy, model_inputs=source) for source in sources]
        outputs = {}
        while engine.has_unfinished():
            outputs.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        assert [outputs[i] for i in ids] == plain, f"{config['method']}: differs from plain generate() on each source alone"
        assert encoded == [4] * (1 if config["method"] == "ngram" else 2), encoded  # the target's, then the draft's
        assert engine.num_kv_blocks_used == 0


def test_engine_sampled_requests_whose_batched_encoder_failed_keep_their_draft_sampling(monkeypatch):
    """When the batch of joining sources raises, each request runs alone; a sampled request's drafts are again
    sampled from the draft model's processed distribution (the release before it dropped that), so each request's
    seeded tokens equal those of the same request admitted alone. Without the restore they differ (checked)."""
    model = families.build_tiny_encoder_decoder("t5")
    batch = source_inputs(model, batch=3)
    sources = [{name: values[row : row + 1, :7] for name, values in batch.items()} for row in range(3)]
    start = [model.generation_config.decoder_start_token_id]
    sampled = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": True, "temperature": 1.5}
    config = {"method": "draft_model", "model": perturbed_copy(model, scale=0.3), "num_speculative_tokens": 3}
    hand_over = engine_module.hand_over_sources

    def run(batch_fails: bool) -> tuple[list[list[int]], int]:
        def hand_over_one_at_a_time(engine, rows, *args):
            if len(rows) > 1 and batch_fails:
                raise RuntimeError("the batch's sources")
            return hand_over(engine, rows, *args)

        monkeypatch.setattr(engine_module, "hand_over_sources", hand_over_one_at_a_time)
        if not batch_fails:  # each joins alone
            monkeypatch.setattr(engine_module, "_batchable_groups", lambda joining, lengths: [[one] for one in joining])
        engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=4)
        ids = [engine.add_request(start, sampled, seed=11 + i, model_inputs=source) for i, source in enumerate(sources)]
        outputs = {}
        while engine.has_unfinished():
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        assert all(outputs[i].finish_reason == "length" for i in ids)
        return [outputs[i].token_ids for i in ids], engine.metrics.num_accepted_tokens

    after_failure, accepted = run(batch_fails=True)
    assert after_failure == run(batch_fails=False)[0] and accepted > 0


def test_engine_admits_sources_up_to_the_prefill_budget():
    """With `prefill_chunk_size`, requests join while their sources hold that many tokens in all (one at least):
    the encoder's runs bound a step's stall as prompt chunks do."""
    model = families.build_tiny_encoder_decoder("t5")
    sources = sources_of_their_own(model, 3)
    assert [source["input_ids"].shape[1] for source in sources] == [10, 9, 5]
    engine = hf_specdec.SpeculativeEngine(model, {"method": "ngram", "num_speculative_tokens": 2}, max_batch_size=4, prefill_chunk_size=12)
    start = [model.generation_config.decoder_start_token_id]
    for source in sources:
        engine.add_request(start, {"max_new_tokens": 12, "min_new_tokens": 12}, model_inputs=source)
    waiting = []
    for _ in range(3):
        engine.step()
        waiting.append(engine.num_waiting)
    assert waiting == [2, 1, 0]  # 10 alone; 9 (5 more would pass 12); 5


def test_engine_sampled_requests_follow_the_exact_distribution_beside_longer_sources(monkeypatch):
    """A 16-token BART in the engine, every row in one forward: requests for one short source, each beside requests
    with a longer source (so the short one is padded in the batch), sampled with a sampled draft model; P(3 new
    tokens) enumerated from plain generate()'s processed scores on the short source alone. Broken: the padded
    batch's mask dropped, which must fail the same test."""
    config = families.tiny_encoder_decoder_config("bart", init_scale=1.0)
    config.vocab_size = SMALL_VOCAB_SIZE
    model = families.build_tiny_encoder_decoder("bart", config=config)
    check_architecture(model)
    assert not runs_one_row_per_forward(model)
    model.generation_config.eos_token_id = None
    short, longer = torch.tensor([PROMPT]), torch.tensor([PROMPT + PROMPT[:3]])
    start = [families.BOS_TOKEN_ID]  # the decoder's start
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_decoder_distribution(model, short, torch.ones_like(short), start[0], sampling)
    draft = {"method": "draft_model", "model": perturbed_copy(model, scale=0.3), "num_speculative_tokens": 2}
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": True, **sampling}

    def samples(count: int) -> np.ndarray:
        engine = hf_specdec.SpeculativeEngine(model, draft, max_batch_size=64)
        wanted = set()
        for seed in range(2 * count):
            source = short if seed % 2 else longer
            request = engine.add_request(start, options, seed=seed, model_inputs={"input_ids": source})
            if seed % 2:
                wanted.add(request)
        out = []
        while engine.has_unfinished():
            out.extend(o.token_ids for o in engine.step() if o.finished and o.request_id in wanted)
        assert engine.metrics.num_draft_tokens > engine.metrics.num_accepted_tokens > 0
        return np.array(out)

    right = chi_square_pvalue(samples(2000), exact)
    stack = own_attention._stack_sources
    monkeypatch.setattr(own_attention, "_stack_sources", lambda sources: (stack(sources)[0], None))
    wrong = chi_square_pvalue(samples(500), exact)
    assert right > 1e-3 and wrong < 1e-3, (right, wrong)


def exact_decoder_distribution(model, source, mask, start: int, sampling: dict) -> dict[tuple[int, ...], float]:
    """P(next 3 decoder tokens) by enumeration, from plain generate()'s processed scores after every prefix."""
    probs = {}
    for depth in range(NEW_TOKENS):
        suffixes = list(itertools.product(range(SMALL_VOCAB_SIZE), repeat=depth))
        decoder_ids = torch.tensor([[start, *suffix] for suffix in suffixes])
        out = plain_generate(
            model, input_ids=source.repeat(len(suffixes), 1), attention_mask=mask.repeat(len(suffixes), 1),
            decoder_input_ids=decoder_ids, max_new_tokens=1, do_sample=True, output_scores=True,
            return_dict_in_generate=True, **sampling,
        )  # fmt: skip
        for suffix, p in zip(suffixes, torch.softmax(out.scores[-1].double(), dim=-1)):
            probs[suffix] = p
    return {
        triple: float(probs[()][triple[0]] * probs[triple[:1]][triple[1]] * probs[triple[:2]][triple[2]])
        for triple in itertools.product(range(SMALL_VOCAB_SIZE), repeat=NEW_TOKENS)
    }
