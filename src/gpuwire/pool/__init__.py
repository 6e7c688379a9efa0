"""The pool: gpuwire's control plane (``gpuwire pool``).

The pool knows the nodes (registration + heartbeats), their GPUs and free capacity, the
tenants and their API keys, and hands out **leases**: whole GPUs or slices of one (a memory
budget and a compute share), each with a token signed by the pool that the node verifies
locally. The pool is never on the data path: clients talk to nodes directly, so a pool
outage stops no running job.

Modules, from the inside out:

* ``sizes``     -- human sizes ("8GiB") to bytes and back;
* ``placement`` -- pure placement functions (no I/O): which GPU(s) a request goes to;
* ``tokens``    -- Ed25519-signed JWT lease tokens; ``verify`` is what a node runs;
* ``store``     -- the state (nodes, GPUs, leases, tenants, API keys, queue) behind a small
  interface, implemented on SQLAlchemy Core (SQLite in WAL mode by default);
* ``core``      -- the pool's logic (register, heartbeat, lease, queue, quotas, reaper);
* ``service``   -- the HTTP/JSON API (FastAPI on uvicorn) over ``core``;
* ``client``    -- a small synchronous HTTP client (CLI, node agent, ``gpuwire run``);
* ``agent``     -- the node side: registration, heartbeats, ``make_token_verifier``;
* ``cli``/``demo`` -- the ``gpuwire pool|tenant|key|ls|demo`` commands and ``smi --pool``.

Importing this package is cheap: nothing heavy is imported until a module is used.
"""
