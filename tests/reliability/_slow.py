import time
def slow(response, ground_truth):
    if len(response) > 10: time.sleep(100)
    return 1.0
