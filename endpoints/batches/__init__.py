"""The OpenAI Files and Batch API (the Django app labelled `batches`): files whose bytes live in S3
(`storage`), batches validated up front (`validation`), run line by line through the gateway's own
call path at the endpoint's batch price and low engine priority (`runner`), on warm capacity only
(`scheduling`), and assembled into OpenAI's output and error files (`services`)."""
