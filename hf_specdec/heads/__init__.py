"""EAGLE / EAGLE-3 heads: the module, its checkpoint formats (ours, the EAGLE authors', SpecForge /
speculators), model cards and publishing to the Hub."""
