"""What kvstore sends over its sockets, one module per wire: the local socket's framing
(:mod:`kvstore.wire.framing`), RESP2 for the Redis tier's block bytes (:mod:`kvstore.wire.resp`)
and for the directory's pipelined calls (:mod:`kvstore.wire.resp_pipe`), the peer data path
(:mod:`kvstore.wire.peer`); and the one loop of ``sendmsg`` and ``recv_into`` they share
(:mod:`kvstore.wire.stream`). Codecs and socket I/O only: who may connect (the cluster's hello,
the sidecar's token) stays with whoever decides it."""
