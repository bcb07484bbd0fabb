"""Prefill/decode disaggregation (docs/architecture.md, "Disaggregation")."""
