"""Masters in a cluster (``tidekv master --etcd ... --cluster``): ``cluster`` (a master's role),
``election`` (who leads, by an etcd lease), ``replication`` (the leader streams its journal to the
standbys) and ``etcd`` (the few etcd calls, also used by clients to find the leader)."""
