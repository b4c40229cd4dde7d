"""The engine: requests in, scheduled model steps, token chunks out.

`engine.Engine` (the step loop's logic), `async_engine.AsyncEngine` (that loop on its own thread,
fed from asyncio), `model_runner.ModelRunner` (one forward + sampling over a batch),
`cuda_graph` (captured decode steps) and `tp_runner` (the runner across tensor-parallel ranks).
"""
