"""Which kind of inference call a request path is: the `endpoint` of the metrics and the
activity log.

Written once, here, because the metrics (`gpuproxy/observe/`) and the activity record both
need it and this is the lowest layer both import. The value comes from a fixed set, never the
raw path, so a Prometheus label built from it stays bounded whatever clients send: an
unexpected path is `other`. llama-swap's versionless aliases (`/v/chat/completions`) and its
unversioned llama.cpp paths count as the `/v1/` call they stand for, so a dashboard does not
split one workload in two; `/upstream/<model>/...` is a passthrough whose body the proxy does
not interpret, so it is `upstream` whatever it calls.
"""

from __future__ import annotations

CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"
MESSAGES = "messages"
COUNT_TOKENS = "count_tokens"
EMBEDDINGS = "embeddings"
RERANK = "rerank"
INFILL = "infill"
SPEECH = "speech"
VOICES = "voices"
TRANSCRIPTIONS = "transcriptions"
IMAGE_GENERATIONS = "image_generations"
IMAGE_EDITS = "image_edits"
PROPS = "props"
UPSTREAM = "upstream"
OTHER = "other"

# Every inference path gpuproxy/proxy/inference.py dispatches by model, except the `/v/...`
# aliases (read as their `/v1/` path); tests/test_metrics_endpoint.py holds the two lists
# together.
BY_PATH: dict[str, str] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/completion": COMPLETIONS,  # llama.cpp's native completion
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT_TOKENS,
    "/v1/embeddings": EMBEDDINGS,
    "/v1/rerank": RERANK,
    "/v1/reranking": RERANK,
    "/rerank": RERANK,
    "/reranking": RERANK,
    "/infill": INFILL,
    "/v1/audio/speech": SPEECH,
    "/v1/audio/voices": VOICES,
    "/v1/audio/transcriptions": TRANSCRIPTIONS,
    "/v1/images/generations": IMAGE_GENERATIONS,
    "/v1/images/edits": IMAGE_EDITS,
    "/props": PROPS,
}
ALL: tuple[str, ...] = (*dict.fromkeys(BY_PATH.values()), UPSTREAM, OTHER)

MAX_LENGTH = max(map(len, ALL))


def endpoint(path: str) -> str:
    """The endpoint of a request path (without its query string)."""
    found = BY_PATH.get("/v1/" + path[3:] if path.startswith("/v/") else path)
    if found is not None:
        return found
    return UPSTREAM if path.startswith("/upstream/") else OTHER
