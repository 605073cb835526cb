"""Images in /v1/chat/completions over real HTTP: a tiny random Gemma 3 with a one-layer SigLIP tower,
saved as a Hub-style folder with its processor (SmolLM2's tokenizer plus Gemma 3's image tokens, a
32-pixel image processor, a ChatML template that places images), loaded as `hf-specdec serve` loads
a folder. Every greedy reply equals plain `generate()` on the processor's inputs for the same chat.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import ngram_config, plain_generate
from PIL import Image
from test_server import running_server
from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from hf_specdec import SpeculativeEngine
from hf_specdec.models.real_models import load_image_processor, load_target, smollm2_path
from hf_specdec.serving import build_app

MODEL_NAME = "tiny-gemma3-vlm"
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<start_of_image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def png_url(seed: int, size: tuple[int, int] = (40, 48)) -> str:
    """A PNG of one colour with a little noise (random noise alone looks alike to a random vision tower)."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(rng.integers(0, 256, 3) + rng.normal(0, 8, (*size, 3)), 0, 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(text: str, seed: int) -> dict:
    return {"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": png_url(seed)}},
    ]}  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The model and its processor saved as on the Hub."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path(), extra_special_tokens=IMAGE_TOKENS)
    processor = Gemma3Processor(
        Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer, chat_template=TEMPLATE, image_seq_length=4
    )
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], initializer_range=0.2, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, pad_token_id=0,
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id, initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(MODEL_NAME)
    model = Gemma3ForConditionalGeneration(config)
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)  # zeros at init
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def served(folder):
    """The folder loaded as `hf-specdec serve --model <folder>` loads it, and a copy for plain generate()."""
    model, tokenizer = load_target(folder, "auto", "cpu")
    processor = load_image_processor(folder)
    assert isinstance(model, Gemma3ForConditionalGeneration) and isinstance(processor, Gemma3Processor)
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=4, tokenizer=tokenizer)
    with running_server(build_app(engine, tokenizer, MODEL_NAME, processor=processor)) as url:
        yield url, load_target(folder, "auto", "cpu")[0], processor


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)


def plain_reply(reference, processor, messages: list[dict], max_new_tokens: int) -> tuple[str, int]:
    """Plain greedy generate() on what the processor makes of the chat (images as PIL): (text, prompt tokens)."""
    chat = [
        {**m, "content": [
            {"type": "image", "image": Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",")[1])))}
            if p["type"] == "image_url" else p for p in m["content"]
        ]} if isinstance(m["content"], list) else m
        for m in messages
    ]  # fmt: skip
    inputs = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")  # fmt: skip
    out = plain_generate(reference, **inputs, max_new_tokens=max_new_tokens, do_sample=False)
    width = inputs["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, width:], skip_special_tokens=True), width


def test_chat_with_an_image_is_plain_generate_on_the_processors_inputs(served, client):
    _, reference, processor = served
    messages = [{"role": "system", "content": "Be brief."}, image_message("What is in this picture?", seed=1)]
    expected, prompt_tokens = plain_reply(reference, processor, messages, 24)
    other_image = plain_reply(reference, processor, [messages[0], image_message("What is in this picture?", 2)], 24)
    assert other_image[0] != expected, "the image does not change the reply: the test would not notice it dropped"
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=24)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == prompt_tokens  # the image's tokens, as the processor expands them
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=24,
                                                 stream=True))  # fmt: skip
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected
    two = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=24, n=2)
    assert [choice.message.content for choice in two.choices] == [expected, expected]  # each choice prefilled


def test_image_and_text_requests_at_once_each_match_plain_generate(served, client):
    """Requests with images join a batch in which others decode (the engine pauses its paged attention
    for the model's own prefill); text-only chats on the same model go through its chat template."""
    from concurrent.futures import ThreadPoolExecutor

    _, reference, processor = served
    chats = [[image_message(f"Describe picture {i}.", seed=10 + i)] if i % 2 else
             [{"role": "user", "content": f"Count to {i}."}] for i in range(6)]  # fmt: skip
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(
            lambda chat: client.chat.completions.create(model=MODEL_NAME, messages=chat, temperature=0, max_tokens=30),
            chats,
        ))  # fmt: skip
    for chat, reply in zip(chats, replies):
        assert reply.choices[0].message.content == plain_reply(reference, processor, chat, 30)[0]


@pytest.mark.parametrize(
    ("content", "param", "words"),
    [
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "messages[0].content",
         "the server fetches no URLs"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1000}}],
         "messages[0].content[0].image_url.url", "does not hold an image"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}],
         "messages[0].content[0].image_url.url", "does not hold an image"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}}],
         "messages[0].content", "content[0].image_url.detail"),
        ([{"type": "input_audio", "input_audio": {}}], "messages[0].content", "audio, files: not supported"),
    ],
)
def test_bad_images_are_400s_naming_the_part(served, content, param, words):
    response = httpx.post(f"{served[0]}/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
    })  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert len(error["message"]) < 600  # a refused image's base64 is not echoed back whole


def test_images_only_in_user_messages(served):
    image = {"type": "image_url", "image_url": {"url": png_url(0)}}
    response = httpx.post(f"{served[0]}/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "system", "content": [image]}], "max_tokens": 2,
    })  # fmt: skip
    assert response.status_code == 400 and "only in user messages" in response.json()["error"]["message"]


def test_engine_request_with_images_that_do_not_fit_its_tokens_fails_alone(folder):
    """Pixel values for two images against one image's tokens: the model's own prefill raises, that
    request ends with an error, the one decoding beside it is untouched and the pool empties."""
    model, tokenizer = load_target(folder, "auto", "cpu")
    processor = load_image_processor(folder)
    chat = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "image": Image.new("RGB", (8, 8))}]}]
    inputs = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")  # fmt: skip
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=2)
    text_prompt = tokenizer("one two three one two three").input_ids
    text_id = engine.add_request(text_prompt, {"max_new_tokens": 12, "do_sample": False})
    engine.step()
    bad_id = engine.add_request(
        inputs["input_ids"][0], {"max_new_tokens": 12, "do_sample": False},
        model_inputs={"pixel_values": inputs["pixel_values"].repeat(2, 1, 1, 1), "token_type_ids": inputs["token_type_ids"]},
    )  # fmt: skip
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished[bad_id].finish_reason == "error" and finished[bad_id].token_ids == []
    expected = plain_generate(model, input_ids=torch.tensor([text_prompt]), max_new_tokens=12, do_sample=False)
    assert finished[text_id].token_ids == expected[0, len(text_prompt):].tolist()
    assert engine.num_kv_blocks_used == 0
    with pytest.raises(ValueError, match=r"model_inputs: \['attention_mask'\] are the engine's own"):
        engine.add_request(inputs["input_ids"][0], model_inputs={"attention_mask": inputs["attention_mask"]})
    with pytest.raises(ValueError, match="model_inputs must be a dict of input names to tensors"):
        engine.add_request(inputs["input_ids"][0], model_inputs={"pixel_values": [1.0]})


QWEN_TEMPLATE = TEMPLATE.replace("<start_of_image>", "<|vision_start|><|image_pad|><|vision_end|>")


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    """A tiny Qwen2.5-VL (M-RoPE) and transformers' own Qwen2.5-VL processor (not saved: its video
    processor needs torchvision, which CI does not install; built here without one): 4-px patches
    merged 2x2, images resized to 8-32 px a side, so each gives 1-16 tokens on a grid of its own shape."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(
        smollm2_path(), extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>"]})
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 64, "longest_edge": 1024}
    )
    with pytest.MonkeyPatch.context() as patch:  # the class check looks the video processor class up
        patch.setattr(Qwen2_5_VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
        processor = Qwen2_5_VLProcessor(image_processor, tokenizer, chat_template=QWEN_TEMPLATE)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        initializer_range=0.2,  # sharp attention: positions change the reply
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[0])  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id, vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"), eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    tokenizer.chat_template = QWEN_TEMPLATE  # text-only chats go through the tokenizer's, as on the Hub
    tokenizer.save_pretrained(path)
    return str(path), processor


def test_mrope_model_chats_with_images_are_plain_generate(qwen_folder):
    """Qwen2.5-VL's processor gives `image_grid_thw` and `mm_token_type_ids` beside the pixels; the text
    after each image continues at the model's own (M-RoPE) positions. Chats with images of two shapes
    and a text chat, at once."""
    from concurrent.futures import ThreadPoolExecutor

    folder, processor = qwen_folder
    model, tokenizer = load_target(folder, "auto", "cpu")
    reference = load_target(folder, "auto", "cpu")[0]
    chats = [[image_message("What is this?", seed=1)], [{"role": "user", "content": "Count to 5."}],
             [{"role": "user", "content": [{"type": "text", "text": "And this?"},
                                           {"type": "image_url", "image_url": {"url": png_url(2, size=(16, 8))}}]}]]  # fmt: skip
    expected = [plain_reply(reference, processor, chat, 24)[0] for chat in chats]
    assert expected[0] != plain_reply(reference, processor, [image_message("What is this?", seed=3)], 24)[0], (
        "the image does not change the reply: the test would not notice it dropped"
    )
    engine = SpeculativeEngine(model, ngram_config(k=3), max_batch_size=4, tokenizer=tokenizer)
    with running_server(build_app(engine, tokenizer, "tiny-qwen", processor=processor)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda chat: client.chat.completions.create(
                model="tiny-qwen", messages=chat, temperature=0, max_tokens=24), chats))  # fmt: skip
    assert [reply.choices[0].message.content for reply in replies] == expected
