"""`cupy-llama serve`: an OpenAI-compatible HTTP API over the engine process.

protocol.py  request models and response builders (no HTTP: the batch front end uses them)
app.py       the FastAPI application: routes, API key, errors, server-sent events, shutdown
metrics.py   Prometheus metrics (`cupy_llama:` names)

The engine loop itself is engine/async_engine.py. app.py and metrics.py need the `serve`
extra (fastapi, uvicorn, prometheus_client); protocol.py needs only pydantic, which
cupy-llama installs (`generate` reads OpenAI batch files with it).
"""
