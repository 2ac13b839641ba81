"""The gateway: radixserve's public GenerationService.

It validates requests, applies chat templates, tokenizes, picks a router replica by prompt
prefix, detokenizes the router's token ids incrementally and cuts the text at stop strings.
It holds no state beyond each open stream.
"""
