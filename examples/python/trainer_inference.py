import _needs; _needs.check("torch", gpu=True)  # says why and exits 3 without torch or a GPU
import sys, torch, cuda_ipc   # python trainer_inference.py train; then, in another shell: ... infer
model = torch.nn.Linear(4096, 4096, device="cuda")
if sys.argv[1:] == ["train"]:
    pub = cuda_ipc.Publisher("demo")                              # a socket only your user can open
    shared = pub.publish_state_dict("model", model.state_dict())  # copied once into shareable memory
    model.load_state_dict(shared, assign=True)                    # from here on, train in place
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for step in range(100_000):
        model(torch.randn(64, 4096, device="cuda")).square().mean().backward()
        opt.step(); opt.zero_grad()
        pub.update_state_dict("model")                            # no copy: one message to each reader
else:
    sd = cuda_ipc.Subscriber("demo").attach_state_dict("model")   # the trainer's memory, mapped: no copy
    model.load_state_dict(sd, assign=True)
    for _ in range(100): print("version", sd.wait_update(timeout=60), "sum", model.weight.sum().item())
