"""Recurrent and convolution state of hybrid models (Mamba, gated delta-net, short-conv layers), per
row, rolled back exactly on rejected drafts.

transformers keeps such a layer's state in a `LinearAttentionLayer` of the model's `Cache` (its
mixers call `cache.update_conv_state` / `update_recurrent_state`), and gives it what speculation
needs: with past recording on (`activate_past_recording(recurrent_states_to_keep=K)`) a forward of n
tokens also yields the recurrent states after each of its last K tokens, the convolution keeps its
whole input window, and `crop(-t)` puts the layer back to where it was t tokens earlier (t < K, or t
<= n). That is how transformers' own assisted decoding rolls hybrids back at batch size 1.

The state tensors are `[batch, ...]` and a crop removes the same count from every batch row, while
our rows accept different numbers of drafts. So each row gets its own set of those layer objects,
and a forward runs one row at a time: `RecurrentStates.select(row)` puts the row's objects into the
cache's layer list before the row's forward (the attention layers stay paged and shared). Rolling a
row back to n tokens crops each of its layers by however many tokens that layer holds beyond n,
which also trims the convolution window and drops the recorded history. K is the most tokens a
rollback may remove plus one (the loop removes at most k rejected drafts).
"""

from __future__ import annotations

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, CacheLayerMixin, LinearAttentionLayer

# transformers' layer types whose cache layer is a pure recurrent / convolution state
RECURRENT_LAYER_TYPES = ("linear_attention", "conv")
# ... and those whose one cache layer holds recurrent state and attention keys / values (Zamba,
# Falcon-H1): the state is the row's, the keys / values go to the shared paged pool of that layer
RECURRENT_AND_ATTENTION_LAYER_TYPES = ("hybrid", "hybrid_sliding")


class RowHybridLayer(LinearAttentionLayer, CacheLayerMixin):
    """One row's cache layer for a layer that is recurrent and attends: its own recurrent / conv state
    (transformers' `LinearAttentionLayer`), its keys / values written to `attention` (the cache's
    `PagedLayer` for that index, shared by every row)."""

    def __init__(self, attention: CacheLayerMixin, number_of_states: int = 1, **kwargs):
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        self.attention = attention

    def update(self, key_states, value_states, *args, **kwargs):
        return self.attention.update(key_states, value_states, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attention.get_mask_sizes(query_length)


class RecurrentStates:
    """Per row, transformers' recurrent cache layers for the model's recurrent layer indices.

    `layer_kwargs[i]`: the constructor arguments transformers gives layer i's cache layer
    (`get_layer_types_and_kwargs`); `max_rollback`: the most tokens one rollback may remove.
    """

    def __init__(self, layer_types: dict[int, str], layer_kwargs: dict[int, dict], max_rollback: int):
        self.layer_types = layer_types
        self.layer_kwargs = layer_kwargs
        self.max_rollback = max_rollback
        self.attention: dict[int, CacheLayerMixin] = {}  # the shared paged layers of "hybrid" indices
        self._rows: dict[int, dict[int, object]] = {}

    def new_layer(self, index: int) -> object:
        """An empty cache layer of the kind transformers gives layer `index`, recording its past."""
        layer_type = self.layer_types[index]
        if layer_type in RECURRENT_AND_ATTENTION_LAYER_TYPES:
            layer = RowHybridLayer(self.attention[index], **self.layer_kwargs[index])
        else:
            layer = DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**self.layer_kwargs[index])
        layer.activate_past_recording(recurrent_states_to_keep=self.max_rollback + 1)
        return layer

    def layers_of(self, row: int) -> dict[int, object]:
        """The row's layer objects, created on its first forward."""
        layers = self._rows.get(row)
        if layers is None:
            layers = self._rows[row] = {index: self.new_layer(index) for index in self.layer_types}
        return layers

    def rollback(self, row: int, num_tokens: int) -> None:
        """Keep the state after the row's first `num_tokens` tokens."""
        for layer in self._rows.get(row, {}).values():
            held = int(layer.get_seq_length())
            if not held - self.max_rollback <= num_tokens <= held:
                raise ValueError(
                    f"cannot roll row {row}'s recurrent state from {held} to {num_tokens} tokens "
                    f"(the states of the last {self.max_rollback} are kept)"
                )
            if layer.has_previous_state[0]:  # a layer never fed has nothing to crop
                layer.crop(num_tokens - held)

    def free(self, row: int) -> None:
        self._rows.pop(row, None)
