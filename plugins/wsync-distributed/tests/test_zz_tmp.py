import threading, time
def test_zz_faults_multi_host_listening():
    from wsync_conformance import resources
    time.sleep(5)
    found = resources.listening_sockets()
    print("THREADS", [t.name for t in threading.enumerate()])
    assert all(resources.is_loopback(a) for a in found), found
