"""The harness: kvstore and its neighbours run as real processes on one machine, the way the
demo, the benchmarks and the tests need them.

* :mod:`kvstore.harness.servers` -- redis-server (one node or a cluster) and moto's S3 server
  on free ports;
* :mod:`kvstore.harness.hosts` -- separate hosts on this machine (network namespaces, a private
  ``/dev/shm`` each; needs root);
* :mod:`kvstore.harness.sidecar` -- ``kvstore serve`` as a process, the way users run it;
* :mod:`kvstore.harness.tiny_model` -- a tiny random-weight Llama and its tokenizer, built here;
* :mod:`kvstore.harness.instance` -- one vLLM instance in a process of its own (the parent's
  side: start it, pace it, read its results), its environment and the connector's config;
* :mod:`kvstore.harness.phases` -- inside that process: the engine runs a spec's phases;
* :mod:`kvstore.harness.handoff` -- a prefill's ``kv_transfer_params`` passed on to the decode
  request through files, as a P/D proxy passes them;
* :mod:`kvstore.harness.cross_host` -- two test hosts with a sidecar each, one cluster.
"""
