"""What hf_specdec needs to know about a target model: which architectures it supports, where their
decoder layers are and how to capture their hidden states, CPU linears, and the real models and
data these machines have."""
