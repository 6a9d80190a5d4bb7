"""Tool calling (OpenAI's `tools`): rendering tools into the prompt, constraining required calls, and
parsing calls out of the model's text (docs/structured.md)."""
