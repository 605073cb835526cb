"""`enable(model)`: the one opt-in line that gives `model.generate` a `speculative_config` argument.

The patched method hands everything to transformers' own `generate` with our loop as its
`custom_generate` callable, so generation-config preparation stays transformers'. Two things
transformers drops for custom callables are carried across here: the streamer, and the
tokenizer that `stop_strings` needs (we build the `StopStringCriteria` ourselves).

`custom_generate=hf_specdec.generate` on an enabled model (both README snippets run in one
notebook) is the same loop: it takes this same path, so the result is the enabled path's,
streamers and stop strings included. Any other `custom_generate` cannot run with
`speculative_config` (both would replace the decoding loop) and is refused.
"""

from __future__ import annotations

import copy
import functools
import threading

from transformers import PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from ..cache.paged_attention import in_use_by_another_thread
from .decoding import generate as speculative_generate


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Let `model.generate(**inputs, speculative_config=...)` speculate. Idempotent; returns the model.

    Without `speculative_config` (or with None) generate behaves exactly as before.
    """
    if not callable(getattr(model, "generate", None)):
        raise ValueError(f"hf_specdec.enable(): {type(model).__name__} has no generate() (a base model?); pass a causal LM")
    if getattr(model.generate, "_hf_specdec_original", None) is not None:
        return model
    original = model.generate

    @functools.wraps(original)
    def generate(*args, speculative_config=None, **kwargs):
        custom = kwargs.get("custom_generate")
        ours = custom is speculative_generate
        if speculative_config is None and not ours:
            if in_use_by_another_thread(model):  # its attention is switched to the paged cache's now
                raise RuntimeError(
                    "another thread is generating with speculative_config on this model instance; plain generate() "
                    "would run on its switched attention: use one model instance per thread"
                )
            return original(*args, **kwargs)
        if custom is not None and not ours:
            raise ValueError(
                "custom_generate cannot be combined with speculative_config: the only custom_generate allowed "
                f"with it is hf_specdec.generate (got {custom!r}); drop custom_generate, "
                "or drop speculative_config to run your own"
            )
        kwargs.pop("custom_generate", None)
        _refuse_token_healing(model, kwargs)
        _move_streamer(kwargs)
        _move_stop_strings_to_criteria(model, kwargs)
        _reached.ours = False
        output = original(*args, custom_generate=_noted_generate, speculative_config=speculative_config, **kwargs)
        if not _reached.ours:  # PEFT wrappers hand it on to their base model; a generate() of its own does not
            raise ValueError(
                f"{type(model).__name__}.generate() does not hand speculative_config to hf_specdec: it is not "
                "transformers' autoregressive GenerationMixin.generate (Diffusion Gemma's block diffusion, say)"
            )
        return output

    generate._hf_specdec_original = original
    model.generate = generate
    return model


# whether the wrapped generate() reached our loop, per thread (each thread runs its own model instance)
_reached = threading.local()


@functools.wraps(speculative_generate)  # transformers reads the callable's signature for its keywords
def _noted_generate(*args, **kwargs):
    _reached.ours = True
    return speculative_generate(*args, **kwargs)


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `enable`."""
    original = getattr(model.generate, "_hf_specdec_original", None)
    if original is not None:
        del model.generate
    return model


def _move_streamer(kwargs: dict) -> None:
    """`streamer=` becomes `speculative_streamer=` (transformers drops `streamer` for custom callables)."""
    streamer = kwargs.pop("streamer", None)
    if streamer is None:
        return
    if kwargs.get("speculative_streamer") is not None:
        raise ValueError("give streamer= or speculative_streamer=, not both (they name the same streamer)")
    kwargs["speculative_streamer"] = streamer


def _refuse_token_healing(model: PreTrainedModel, kwargs: dict) -> None:
    """transformers heals the prompt with the tokenizer it drops for custom callables, and then fails saying
    none was passed: say what to do instead."""
    generation_config = kwargs.get("generation_config") or model.generation_config
    if kwargs.get("token_healing", getattr(generation_config, "token_healing", False)):
        raise ValueError(
            "token_healing is not supported with speculative_config (transformers does not hand the tokenizer to a "
            "custom decoding loop): heal the prompt first, input_ids = model.heal_tokens(input_ids, tokenizer), "
            "and pass the healed ids"
        )


def _move_stop_strings_to_criteria(model: PreTrainedModel, kwargs: dict) -> None:
    generation_config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or getattr(generation_config, "stop_strings", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("stop_strings needs tokenizer= (pass the tokenizer to generate)")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    if getattr(generation_config, "stop_strings", None):
        generation_config = copy.deepcopy(generation_config)
        generation_config.stop_strings = None
        kwargs["generation_config"] = generation_config
