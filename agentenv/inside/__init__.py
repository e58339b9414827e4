"""The programs that run inside every sandbox: standard library only, mounted or sent in, run as PID 1 and
below. ``keeper`` (the request server; the host starts it by ``agentenv.host.keeper_start``) and ``kernel``
(the code interpreter's kernel). They import nothing of agentenv (``tests/unit/test_layout.py``).
"""
