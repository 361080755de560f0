"""The model list (`/v1/models`, llama-swap's shape) and `/upstream/<model>/...` resolution:
what the catalog says a client may name."""

from __future__ import annotations

import time
from typing import Any

from gpuproxy.shell.port import ProxyPort
from gpuproxy.upstream.processes import State
from scheduling.catalog import Catalog, CatalogModel


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


# The top-level fields the capabilities render: a model's `metadata` key of the same name is
# dropped when it has capabilities, so the rendered value is the only one (llama-swap's rule).
CAPPED_METADATA_KEYS = frozenset({"architecture", "capabilities", "supported_parameters",
                                  "context_length"})


def render_capabilities(caps: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/models` fields llama-swap derives from a model's `capabilities` config
    (`in`, `out`, `tools`, `reranker`, `context`): what OpenRouter-style clients read to
    pick a model. Only the fields that say something; none for an empty config."""
    ins: list[str] = list(caps.get("in") or [])
    outs: list[str] = list(caps.get("out") or [])
    fields: dict[str, Any] = {}
    if ins or outs:
        arch: dict[str, Any] = {}
        if ins:
            arch["input_modalities"] = ins
        if outs:
            arch["output_modalities"] = outs
        if ins and outs:
            arch["modality"] = "+".join(ins) + "->" + "+".join(outs)
        fields["architecture"] = arch
    flags: dict[str, bool] = {}
    if "image" in ins:
        flags["vision"] = True
    if ins and outs:
        for flag, source, target in (("audio_transcriptions", "audio", "text"),
                                     ("audio_speech", "text", "audio"),
                                     ("image_generation", "text", "image"),
                                     ("image_to_image", "image", "image")):
            if source in ins and target in outs:
                flags[flag] = True
    if caps.get("tools"):
        flags["function_calling"] = True
        fields["supported_parameters"] = ["tools", "tool_choice"]
    if caps.get("reranker"):
        flags["reranker"] = True
    if ins or outs or caps.get("tools") or caps.get("reranker"):
        fields["capabilities"] = flags
    context = caps.get("context") or 0
    if isinstance(context, int) and context > 0:
        fields["context_length"] = context
    return fields


def _record(model_id: str, m: CatalogModel, loaded: bool, state: str,
            internal: dict[str, Any]) -> dict[str, Any]:
    """One entry, in llama-swap's field order; `name`/`description` only when set."""
    record: dict[str, Any] = {"id": model_id, "object": "model", "created": m.created,
                              "owned_by": "gpuproxy"}
    if m.name.strip():
        record["name"] = m.name.strip()
    if m.description.strip():
        record["description"] = m.description.strip()
    rendered = render_capabilities(m.capabilities)
    record.update(rendered)
    metadata = dict(m.metadata)
    if rendered:
        metadata = {k: v for k, v in metadata.items() if k not in CAPPED_METADATA_KEYS}
    meta: dict[str, Any] = {"llamaswap": {**metadata, **internal}}
    if "context_length" in rendered:
        meta["n_ctx"] = rendered["context_length"]
    meta["gpuproxy"] = {"state": state}
    if m.nodes:  # placed on these nodes of the fleet only
        meta["gpuproxy"]["nodes"] = list(m.nodes)
    record["meta"] = meta
    record["status"] = {"value": "loaded" if loaded else "unloaded"}
    return record


def models_list(rt: ProxyPort, catalog: Catalog) -> dict[str, Any]:
    """OpenAI's model list in llama-swap's shape (its `capabilities` rendering, `meta.llamaswap`
    with `type`, `status`); what only gpuproxy knows goes under `meta.gpuproxy`, so a client
    written for llama-swap reads the same keys. A model placed on other nodes only is listed
    too (the fleet serves it), state `elsewhere` and its nodes under `meta.gpuproxy.nodes`."""
    data = []
    every = {**catalog.models, **catalog.elsewhere_models}
    for model_id, m in sorted(every.items()):
        if m.unlisted:
            continue
        proc = rt.upstream(model_id)
        state = proc.state if proc is not None else State.STOPPED
        loaded = state is State.READY
        shown = "elsewhere" if model_id in catalog.elsewhere_models else state.value
        internal: dict[str, Any] = {"type": "model"}
        if m.aliases:
            internal["aliases"] = list(m.aliases)
        data.append(_record(model_id, m, loaded, shown, internal))
        if catalog.include_aliases_in_list:
            for alias in m.aliases:
                if alias.strip():
                    data.append(_record(alias.strip(), m, loaded, shown,
                                        {"type": "alias", "modelID": model_id}))
    data += routed(rt, catalog, int(time.time()))
    data.sort(key=lambda record: record["id"])
    return {"object": "list", "data": data}


def _entry(entry_id: str, name: str, description: str, metadata: dict[str, Any],
           internal: dict[str, Any], created: int, loaded: bool) -> dict[str, Any]:
    """An entry with no model behind it here (a peer's model, a selector, a profile's pin),
    in llama-swap's shape: no capabilities, `meta.llamaswap` the metadata and `type`."""
    record: dict[str, Any] = {"id": entry_id, "object": "model", "created": created,
                              "owned_by": "gpuproxy"}
    if name.strip():
        record["name"] = name.strip()
    if description.strip():
        record["description"] = description.strip()
    record["meta"] = {"llamaswap": {**metadata, **internal}}
    record["status"] = {"value": "loaded" if loaded else "unloaded"}
    return record


def routed(rt: ProxyPort, catalog: Catalog, created: int) -> list[dict[str, Any]]:
    """Peers' models, selectors and the active profile's pins, as llama-swap lists them
    (`handleListModels`): a peer's model by its `<peer>/<model>` name, `unloaded` (nothing
    here knows its state); a selector `loaded` when a target it would pick now is ready or
    starting (`pin`: its first target only); a pin unless it names nothing or a name that is
    listed already (a model, an alias, a peer's model, a selector)."""
    out: list[dict[str, Any]] = []
    taken = (set(catalog.models) | set(catalog.aliases) | set(catalog.selectors)
             | set(catalog.elsewhere) | set(catalog.elsewhere_aliases))
    for peer_id, peer in catalog.peers.items():
        for model in dict.fromkeys(peer.models):
            fqn = f"{peer_id}/{model}"
            taken.add(fqn)
            if catalog.peer_model(model) == (peer_id, model):
                taken.add(model)
            out.append(_entry(fqn, f"{peer_id}: {model}", "", {},
                              {"type": "peer", "peerID": peer_id}, created, False))
    for selector_id, sel in catalog.selectors.items():
        if sel.unlisted:
            continue
        loaded = False
        for target in sel.targets:
            target_id = catalog.resolve(target)
            proc = rt.upstream(target_id) if target_id is not None else None
            loaded = proc is not None and proc.state in (State.READY, State.STARTING)
            if loaded or sel.strategy == "pin":
                break
        internal: dict[str, Any] = {"type": "selector", "strategy": sel.strategy,
                                    "targets": list(sel.targets)}
        if sel.strategy == "spillover":
            internal["spillover"] = sel.spillover
        out.append(_entry(selector_id, sel.name, sel.description, dict(sel.metadata), internal,
                          created, loaded))
    profile = catalog.profiles.get(catalog.active_profile)
    if profile is not None:
        for pin, pinned in profile.pins.items():
            if pinned and pin not in taken:
                out.append(_entry(pin, "", "", {}, {"type": "profile"}, created, False))
    return out
