"""What a store client and the master agree on: the messages and their version (``protocol``),
keys and buffers as the API takes them (``keys``), tenant names and their prefix (``names``),
and the proof that a mounted segment is the mounting process's own (``mount_proof``)."""
