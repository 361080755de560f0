"""The model list (`/v1/models`, llama-swap's shape) and `/upstream/<model>/...` resolution:
what the catalog says a client may name."""

from __future__ import annotations

from typing import Any

from gpuproxy.shell.port import ProxyPort
from gpuproxy.upstream.processes import State
from scheduling.catalog import Catalog


def resolve_prefix(catalog: Catalog, rest: str) -> tuple[str | None, str | None]:
    """The model whose id (or alias) is the longest prefix of `rest`, and what follows it.

    Model ids may contain slashes (`org/model`), so try the longest candidate first.
    """
    parts = rest.split("/")
    for n in range(len(parts), 0, -1):
        candidate = "/".join(parts[:n])
        model_id = catalog.resolve(candidate)
        if model_id is not None:
            return model_id, ("/".join(parts[n:]) if n < len(parts) else None)
    return None, None


def models_list(rt: ProxyPort, catalog: Catalog) -> dict[str, Any]:
    """OpenAI's model list, with llama-swap's `meta.llamaswap` and `status` additions."""
    data = []
    for model_id, m in sorted(catalog.models.items()):
        if m.unlisted:
            continue
        proc = rt.upstream(model_id)
        loaded = proc is not None and proc.state is State.READY
        record = {
            "id": model_id, "object": "model", "created": m.created, "owned_by": "gpuproxy",
            "name": m.name, "description": m.description,
            "meta": {"llamaswap": {**m.metadata, "aliases": list(m.aliases)}},
            "status": {"value": "loaded" if loaded else "unloaded"},
        }
        if m.capabilities:
            record["capabilities"] = m.capabilities
        data.append(record)
        if catalog.include_aliases_in_list:
            for alias in m.aliases:
                data.append({**record, "id": alias,
                             "meta": {"llamaswap": {**m.metadata, "modelID": model_id}}})
    return {"object": "list", "data": data}
