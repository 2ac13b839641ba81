"""The router's core: prefix cache, pages, scheduler, step builder and request lifecycle.

Plain Python over ints and lists: no module in this folder imports torch, transformers or grpc
(tests/router/test_imports.py imports each one and checks). `router_service.convert` is the one
place its values meet the wire's messages.
"""
