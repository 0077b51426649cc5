"""Request fields that ask for structured output, as one StructuredOutputsParams (or None).

Accepted on both endpoints, at most one constraint per request:
  - OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}};
  - vLLM's `structured_outputs` object: {"json" | "regex" | "choice" | "grammar" | "json_object": ...};
  - vLLM's older top-level names: guided_json, guided_regex, guided_choice, guided_grammar.
`guided_decoding_backend` is ignored (xgrammar is the only backend); whitespace patterns and
structural tags are 501. Compiling (bad schema -> 400) happens when the engine adds the request.
"""

from __future__ import annotations

from deepinfer.sampling_params import SamplingParamsError, StructuredOutputsParams
from deepinfer.serve.errors import bad_request, not_implemented

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_UNSUPPORTED = ("whitespace_pattern", "structural_tag")


def _from_response_format(rf) -> tuple[str, dict] | None:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object", "response_format")
        # OpenAI names the schema `schema`; some clients send `json_schema.json_schema`.
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, (dict, str)):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format")
        return "response_format", {"json": schema}
    if kind == "structural_tag":
        raise not_implemented("response_format type structural_tag is not supported", "response_format")
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")


def _from_structured_outputs(so) -> tuple[str, dict] | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    for name in _UNSUPPORTED:
        if so.get(name) is not None:
            raise not_implemented(f"structured_outputs.{name} is not supported", "structured_outputs")
    fields = {k: so[k] for k in _KINDS if so.get(k) not in (None, False)}
    return ("structured_outputs", fields) if fields else None


def structured_outputs_params(response_format, structured_outputs, extra: dict | None):
    """The request's constraint, or None; a 400 naming the field when it is malformed or doubled."""
    found = []
    if response_format is not None:
        found.append(_from_response_format(response_format))
    found.append(_from_structured_outputs(structured_outputs))
    extra = extra or {}
    if extra.get("guided_whitespace_pattern") is not None:
        raise not_implemented("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    for name, kind in _GUIDED.items():
        if extra.get(name) is not None:
            found.append((name, {kind: extra[name]}))
    found = [f for f in found if f is not None]
    if not found:
        return None
    if len(found) > 1 or len(found[0][1]) > 1:
        names = sorted({f[0] for f in found})
        raise bad_request(f"only one structured output constraint per request (got {', '.join(names)})",
                          names[0])
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except SamplingParamsError as e:
        raise bad_request(str(e), field) from None
