"""`dsv4 router`: one OpenAI API in front of prefill and decode engines (docs/architecture.md,
"Disaggregation")."""
