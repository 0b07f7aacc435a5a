"""The store master: ``MasterService`` (``service``) is the meaning of every request, without
I/O, over the index - ``objects`` (in ``shards``; ``eviction``, ``retired`` bytes, ``repairs``),
``segments``, ``tenants``, ``listing`` - whose every change is an op of the ``journal``.
``MasterServer`` (``server``, one ``connection`` per client) puts it on the network, checks
mounts with their engines (``mount_check``) and exports its ``metrics``; ``collector`` keeps
Python's cycle collector off the index."""
