"""A store client: ``Store`` (``store``) pools this process's memory and moves objects' bytes
itself (``object_io``, ``staging``), keeps its segment mounted (``membership``) and copies the
objects the master asks it to re-replicate (``repair_worker``); ``MasterClient``
(``master_client``, over ``rpc``) is its one way to the master, also used by the proxy and the
plugins' schedulers, which hold no memory."""
