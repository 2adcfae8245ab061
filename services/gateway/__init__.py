"""The gateway: server.py wires apis/ (the front ends) over edge/ (the HTTP edge), turns/ (the turn) and tokens/."""
