"""An OpenAI-compatible HTTP server: `minivllm serve` (FastAPI + uvicorn + sse-starlette)."""
