"""LangChain's structured output and tool binding, unchanged, against the book's server.

Runs in LangChain's own virtualenv (``07_engine/benchmarks/make_langchain_venv.sh``), as a
LangChain user's code would: ``ChatOpenAI(...).with_structured_output(Book, method=...)`` for
``json_schema`` (``response_format`` with the schema), ``function_calling`` (a named tool
choice) and ``json_mode`` (``response_format`` ``json_object``, the fields asked for in the
prompt), then ``bind_tools([get_weather], tool_choice="required")``. Prints one JSON line per
check and exits 1 if any failed. ``json_mode`` constrains the output to *a* JSON object only,
so whether it holds the fields is the model's doing: it is reported, not required.

    .venv-langchain/bin/python 07_engine/benchmarks/langchain_check.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI API root (.../v1)")
    parser.add_argument("--model", help="the served model's name (default: the first the server lists)")
    args = parser.parse_args()

    import httpx
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Book(BaseModel):
        """A book."""

        title: str = Field(max_length=12)
        year: int = Field(ge=1900, le=2030)

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    model = args.model or httpx.get(args.base_url + "/models").json()["data"][0]["id"]
    llm = ChatOpenAI(base_url=args.base_url, api_key="EMPTY", model=model, max_tokens=64, temperature=0, max_retries=0)
    ask = "Name a book. Answer in JSON with the keys title and year."
    failed = False
    for method in ("json_schema", "function_calling", "json_mode"):
        out = llm.with_structured_output(Book, method=method, include_raw=True).invoke(ask)
        parsed, error = out["parsed"], out["parsing_error"]
        ok = isinstance(parsed, Book)
        failed |= not ok and method != "json_mode"
        print(
            json.dumps(
                {"check": f"with_structured_output({method})", "ok": ok, "parsed": repr(parsed), "error": repr(error)}
            )
        )
    bound = llm.bind_tools([get_weather], tool_choice="required")
    calls = bound.invoke("What is the weather in Paris?").tool_calls
    ok = bool(calls) and all(c["name"] == "get_weather" and isinstance(c["args"].get("city"), str) for c in calls)
    failed |= not ok
    print(json.dumps({"check": "bind_tools(required)", "ok": ok, "tool_calls": calls}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
