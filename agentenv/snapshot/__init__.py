"""The snapshot room: a sandbox's processes and files saved, restored, stored, and moved between hosts.

Between ``agentenv.host`` (what a sandbox stands on) and ``agentenv.sandbox`` (the ``Sandbox`` and its lifecycle):
it imports the host, ``agentenv.inside`` and the contract, never the sandbox room, which calls it (its own steps,
``sandbox.snapshotting`` and ``sandbox.migration``, take a snapshot of one sandbox and move it). Its errors
(``CheckpointError``, ``SnapshotNotFound``, ``StoreFullError``, ``TransferError``, ``UntrustedSnapshot``) are the
contract's, in ``agentenv.errors``, since callers of every room catch them. By layer, bottom up:

1. CRIU run directly (docs/architecture.md §2): ``criu`` (the dump, and running CRIU), ``restore`` (the restore,
   runc's work done by agentenv), ``criu_images`` (images rewritten for an imported snapshot's new uid range).
2. Memory that comes later: ``lazy_pages`` (a restored sandbox runs before its memory is in), ``postcopy`` (a
   migration's pages served from the source), ``page_channel`` (the authenticated connection they travel on).
3. The container: ``container`` (the runtime's ``Container`` with its CRIU half: checkpoint, restore).
4. The store: ``store`` (this host's snapshots, their folders and their limit).
5. Between hosts: ``trust`` (the manifest's seal), ``tarcheck`` and ``unpack`` (an archive checked member by
   member, unpacked unprivileged), ``imported`` (an imported record rebuilt from this host's facts), ``transfer``
   (export: packed and sent in sealed, checked chunks; import: received and unpacked), ``shared`` (a store every
   server sees, in the transfer's form).

Each layer imports only those below it.
"""
