"""Ray Serve deployment of ruvllm (docs/scaling.md): imported only when Ray is installed."""
