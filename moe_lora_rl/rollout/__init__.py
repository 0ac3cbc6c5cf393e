"""Rollouts from vLLM with our worker extension: one way to build an engine, one way to generate with routes.

    engine.py        set_engine_env() in main(), then make_engine(model, ...): vLLM's LLM in this process
    generate.py      captured_generate(llm, prompts, params, meta): generate -> pop routes -> checks -> pad
    loop.py          EngineLoop: one thread steps the engine; submit / generate from any thread, every other engine
                     call between two steps; per-token adapter versions; inflight switch | pin
    tickets.py       what a submission to the loop is: Request, the Ticket its results come back on
    server.py        the engine process the drivers use: make_engine + EngineLoop behind a threaded HTTP server
    endpoints.py     that server's HTTP side: the handler of every endpoint, the server that exits with its parent
    guard.py         what that server lets in: the per-run token, the /collective_rpc allow-list, body limits
    protocol.py      its /generate wire (request checks, routes encoding, Sample), shared with the client
    client.py        RolloutEngine: starts server.py, generate() / stream() -> Samples, restarts, the base sync
    engine_transport.py  the client's Transport for pushes (shared memory here, inline HTTP to another host)
    replicas.py      several engines behind one driver; FanOut: one push to all of them
    base.py          how the base reaches engines that start empty (over transfer/'s senders)
    placement.py     where that process runs (this host or another slurm node), pure
    kv_compression.py, kv_meter.py, expert_precision.py   KV compression of the rollouts, the allocator's KV
                     meter, the routed experts' GEMM dtype
    openai_server.py vLLM's own OpenAI server with our extension (transfer's HttpTransport target)

Benches, checks and tests build their engines with make_engine and generate with captured_generate too. Depends on
transfer/ (transports, the base's senders) and vllm/ (the extension's class path); never on bench/ or checks/.
"""
