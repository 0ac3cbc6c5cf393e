"""The upstream compatibility report: every vLLM / verl / megatron-core symbol the package uses, looked up per
version in the installed copies and in wheels, parsed with `ast` (nothing imported, no GPU). vllm/compat.py's
refusal of another vLLM version names it; tests/unit/test_upstream_api.py checks it.

    python -m moe_lora_rl.upstream.report --wheel vllm-0.24.0-*.whl [--all] [--json]

    report.py     the command: sources (installed, wheels), the per-version table, markdown or JSON
    symbols.py    the symbols we use: derived from our source, plus the table of what no import shows
    lookups.py    the ast lookups in a package folder or a wheel (signatures, members, keywords)
"""
