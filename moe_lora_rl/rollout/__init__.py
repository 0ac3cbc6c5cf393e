"""Rollouts from vLLM with our worker extension: one way to build an engine, one way to generate with routes.

    engine.py        set_engine_env() in main(), then make_engine(model, ...): vLLM's LLM in this process
    generate.py      captured_generate(llm, prompts, params, meta): generate -> pop routes -> checks -> pad
    loop.py          EngineLoop: one thread steps the engine; submit / generate from any thread, every other engine
                     call between two steps; per-token adapter versions; inflight switch | pin
    server.py        the engine process the drivers use: make_engine + EngineLoop behind a threaded HTTP server
    guard.py         what that server lets in: the per-run token, the /collective_rpc allow-list, body limits
    protocol.py      its /generate wire (request checks, routes encoding), shared with the client
    client.py        RolloutEngine: starts server.py, generate() / stream() -> Samples, a ShmTransport for pushes
    placement.py     where that process runs (this host or another slurm node), pure
    openai_server.py vLLM's own OpenAI server with our extension (refit's HttpTransport target)

Benches, checks and tests build their engines with make_engine and generate with captured_generate too. Depends on
refit/ (transports) and vllm/ (the extension's class path); never on bench/ or checks/.
"""
