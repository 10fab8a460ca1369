"""Prompts for the lookahead tests, shared by the text, server and Ray suites: ``COPY`` and ``QUOTE``
answers copy their prompt (so the default ``speculate="auto"`` drafts and has drafts accepted),
``OPEN`` is open-ended (it drafts almost nothing)."""

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
COPY = [{"role": "user", "content": "Rewrite this Python function with the variable subtotal renamed to base. "
         "Output only the code.\n\n" + CODE}]
QUOTE = [{"role": "user", "content": "Repeat this sentence exactly, and nothing else: The old lighthouse keeper "
          "climbed the stairs every evening to light the lamp for the fishing boats."}]
OPEN = [{"role": "user", "content": "Write a short story about a dragon who learns to bake bread."}]
