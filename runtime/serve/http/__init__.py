"""The OpenAI-compatible HTTP server: a FastAPI app on uvicorn in front of a radixserve public ZeroMQ endpoint.

server.py runs it (`python -m runtime.serve.http --backend tcp://127.0.0.1:5557 --port 8000`), app.py holds the routes,
openai_schema.py the request bodies, responses.py / streaming.py the answers, errors.py the OpenAI error shape.
No module here imports torch.
"""
