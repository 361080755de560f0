"""Real-upstream helpers for tests, demos and benchmarks: a tiny llama GGUF model generator
(`tinymodel`) and a llama-server look-alike over xllamacpp (`llama_server`).

They need the test extras (`pip install -e '.[test]'`: xllamacpp, gguf, numpy); nothing in the
proxy itself imports this package.
"""
