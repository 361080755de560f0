"""The scheduling core: a pure state machine. Standard library only; no Django, no asyncio, no
clock reads (every event carries `now`). The async shell is `gpuproxy/shell/run_loop.py`."""
