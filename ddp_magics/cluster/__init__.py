"""The cluster layer: one ipyparallel cluster whose engines are the ranks of a process group.

- :mod:`~ddp_magics.cluster.rank_cluster`: :class:`RankCluster`, what the rest of the notebook
  side uses;
- :mod:`~ddp_magics.cluster.records`: its plain records and vocabulary (config, ranks, outputs,
  failures, recoveries);
- :mod:`~ddp_magics.cluster.engines`: the only code that calls ipyparallel's client;
- :mod:`~ddp_magics.cluster.lifecycle`: the cluster's processes and files, start to stop;
- :mod:`~ddp_magics.cluster.process_group`: engines made ranks of one group (and again at recovery);
- :mod:`~ddp_magics.cluster.recovery`: every rank back to a working group, state kept;
- :mod:`~ddp_magics.cluster.strays`: this user's clusters, their owners, those left behind;
- :mod:`~ddp_magics.cluster.hosts`, :mod:`~ddp_magics.cluster.launcher`: other hosts over ssh,
  and how engine processes come to be.
"""
