"""Cache and attention: the paged KV cache (a transformers `Cache`), its MLA variant, and the
attention function registered with transformers' `AttentionInterface` that reads it."""
