"""colo_rollout's patch to DeepEP V1 (upstream 567632d): split-phase normal dispatch.

usage: colo_patches.py SRC_DIR   (scripts/deepep_setup.sh appends this file to the build's
apply_patches.py, so the build stamp -- and a prebuilt package's -- covers it)

  split_notify  csrc/deep_ep.{hpp,cpp}: the intranode normal dispatch in two halves, as the
                paper's section 5 splits it after the expert notification:
                * ``intranode_notify(num_tokens_per_rank, is_token_in_rank,
                  num_tokens_per_expert, expert_alignment, config)`` launches only the
                  notification (notify_dispatch: peers learn this rank's counts, the prefix
                  matrices are computed) on the buffer's comm stream and returns the two prefix
                  matrices; no host wait;
                * ``intranode_notified_counts(num_local_experts)`` polls the mapped receive
                  counters once, without waiting: [] while the notification has not landed, else
                  [tokens received, tokens per local expert...];
                * ``intranode_dispatch`` given the notify's prefix matrices AND the per-expert
                  counts tensor (a combination upstream never passes) is the send half: no
                  notification, no host wait, top-k ids and weights carried as in the normal
                  path; ``cached_num_recv_tokens`` must be the count the poll returned.
                Upstream paths (non-cached, cached) are unchanged.

Each patch replaces one exact snippet and fails loudly when it does not match once.
"""
import pathlib
import sys

COLO_MARK = "[colo_rollout patch]"


def colo_patch(root, rel, old, new, name):
    p = root / rel
    text = p.read_text()
    if COLO_MARK + " " + name in text:
        print(f"patch {name}: already applied to {rel}")
        return
    n = text.count(old)
    if n != 1:
        sys.exit(f"patch {name}: expected exactly 1 match in {rel}, found {n}")
    p.write_text(text.replace(old, new, 1))
    print(f"patch {name}: applied to {rel}")


NOTIFY_DECL = """    // {mark} split_notify: the normal dispatch's notification half and a non-blocking count poll
    std::tuple<torch::Tensor, torch::Tensor> intranode_notify(const torch::Tensor& num_tokens_per_rank,
                                                              const torch::Tensor& is_token_in_rank,
                                                              const torch::Tensor& num_tokens_per_expert,
                                                              int expert_alignment,
                                                              const Config& config);

    std::vector<int> intranode_notified_counts(int num_local_experts) const;

    std::tuple<torch::Tensor, std::optional<torch::Tensor>, std::optional<EventHandle>> intranode_combine(
"""

NOTIFY_DEF = """// {mark} split_notify: the notification half of the normal intranode dispatch (see colo_patches.py)
std::tuple<torch::Tensor, torch::Tensor> Buffer::intranode_notify(const torch::Tensor& num_tokens_per_rank,
                                                                  const torch::Tensor& is_token_in_rank,
                                                                  const torch::Tensor& num_tokens_per_expert,
                                                                  int expert_alignment,
                                                                  const Config& config) {
    EP_HOST_ASSERT(config.num_sms % 2 == 0);
    int num_channels = config.num_sms / 2;
    EP_HOST_ASSERT(num_tokens_per_rank.scalar_type() == torch::kInt32);
    EP_HOST_ASSERT(num_tokens_per_expert.scalar_type() == torch::kInt32);
    EP_HOST_ASSERT(is_token_in_rank.scalar_type() == torch::kBool);
    EP_HOST_ASSERT(is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous());
    EP_HOST_ASSERT(is_token_in_rank.size(1) == num_ranks);
    EP_HOST_ASSERT(num_tokens_per_rank.dim() == 1 and num_tokens_per_rank.is_contiguous());
    EP_HOST_ASSERT(num_tokens_per_rank.size(0) == num_ranks);
    EP_HOST_ASSERT(num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.is_contiguous());
    EP_HOST_ASSERT(num_tokens_per_expert.size(0) % num_ranks == 0);
    EP_HOST_ASSERT(num_tokens_per_expert.size(0) / num_ranks <= NUM_MAX_LOCAL_EXPERTS);
    auto num_tokens = static_cast<int>(is_token_in_rank.size(0));
    auto num_experts = static_cast<int>(num_tokens_per_expert.size(0)), num_local_experts = num_experts / num_ranks;

    // the layout tensors come from the caller's stream
    auto compute_stream = at::cuda::getCurrentCUDAStream();
    stream_wait(comm_stream, compute_stream);
    auto rank_prefix_matrix = torch::empty({num_ranks, num_ranks}, dtype(torch::kInt32).device(torch::kCUDA));
    auto channel_prefix_matrix = torch::empty({num_ranks, num_channels}, dtype(torch::kInt32).device(torch::kCUDA));
    int num_memset_int = num_channels * num_ranks * 4;
    *moe_recv_counter = -1;
    for (int i = 0; i < num_local_experts; ++i)
        moe_recv_expert_counter[i] = -1;
    EP_HOST_ASSERT(num_ranks * (num_ranks + num_local_experts) * sizeof(int) <= num_nvl_bytes);
    intranode::notify_dispatch(num_tokens_per_rank.data_ptr<int>(),
                               moe_recv_counter_mapped,
                               num_ranks,
                               num_tokens_per_expert.data_ptr<int>(),
                               moe_recv_expert_counter_mapped,
                               num_experts,
                               num_tokens,
                               is_token_in_rank.data_ptr<bool>(),
                               channel_prefix_matrix.data_ptr<int>(),
                               rank_prefix_matrix.data_ptr<int>(),
                               num_memset_int,
                               expert_alignment,
                               buffer_ptrs_gpu,
                               barrier_signal_ptrs_gpu,
                               rank,
                               comm_stream,
                               num_channels);
    // used on comm_stream (the notify kernel, then the send half): keep them alive for it
    for (auto& t : {num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, rank_prefix_matrix, channel_prefix_matrix})
        t.record_stream(comm_stream);
    return {rank_prefix_matrix, channel_prefix_matrix};
}

std::vector<int> Buffer::intranode_notified_counts(int num_local_experts) const {
    int num_recv_tokens = static_cast<int>(*moe_recv_counter);
    if (num_recv_tokens < 0)
        return {};
    std::vector<int> counts{num_recv_tokens};
    for (int i = 0; i < num_local_experts; ++i) {
        if (moe_recv_expert_counter[i] < 0)
            return {};
        counts.push_back(static_cast<int>(moe_recv_expert_counter[i]));
    }
    return counts;
}

std::tuple<torch::Tensor,
           std::optional<torch::Tensor>,
           std::optional<torch::Tensor>,
           std::optional<torch::Tensor>,
           std::vector<int>,
           torch::Tensor,
           torch::Tensor,
           torch::Tensor,
           torch::Tensor,
           torch::Tensor,
           std::optional<EventHandle>>
Buffer::intranode_dispatch(const torch::Tensor& x,
"""


def colo_main(root):
    mark = COLO_MARK
    colo_patch(root, "csrc/deep_ep.hpp",
               "    std::tuple<torch::Tensor, std::optional<torch::Tensor>, std::optional<EventHandle>> intranode_combine(\n",
               NOTIFY_DECL.replace("{mark}", mark), "split_notify")
    colo_patch(root, "csrc/deep_ep.cpp",
               "std::tuple<torch::Tensor,\n"
               "           std::optional<torch::Tensor>,\n"
               "           std::optional<torch::Tensor>,\n"
               "           std::optional<torch::Tensor>,\n"
               "           std::vector<int>,\n"
               "           torch::Tensor,\n"
               "           torch::Tensor,\n"
               "           torch::Tensor,\n"
               "           torch::Tensor,\n"
               "           torch::Tensor,\n"
               "           std::optional<EventHandle>>\n"
               "Buffer::intranode_dispatch(const torch::Tensor& x,\n",
               NOTIFY_DEF.replace("{mark}", mark), "split_notify")
    colo_patch(root, "csrc/deep_ep.cpp",
               "    bool cached_mode = cached_rank_prefix_matrix.has_value();\n\n"
               "    // One channel use two blocks",
               "    // " + mark + " split_notify_send: the notify's prefix matrices together with the per-expert\n"
               "    // counts tensor select the send half of a split dispatch (no notification, no host wait)\n"
               "    bool notified_mode = cached_rank_prefix_matrix.has_value() and num_tokens_per_expert.has_value();\n"
               "    bool cached_mode = cached_rank_prefix_matrix.has_value() and not notified_mode;\n\n"
               "    // One channel use two blocks",
               "split_notify_send")
    colo_patch(root, "csrc/deep_ep.cpp",
               "            rank_prefix_matrix.data_ptr<int>(), num_memset_int, buffer_ptrs_gpu, barrier_signal_ptrs_gpu, rank, num_ranks, comm_stream);\n"
               "    } else {\n"
               "        rank_prefix_matrix = torch::empty({num_ranks, num_ranks}, dtype(torch::kInt32).device(torch::kCUDA));\n",
               "            rank_prefix_matrix.data_ptr<int>(), num_memset_int, buffer_ptrs_gpu, barrier_signal_ptrs_gpu, rank, num_ranks, comm_stream);\n"
               "    } else if (notified_mode) {\n"
               "        // " + mark + " split_notify_counts: intranode_notify ran the notification on comm_stream and the\n"
               "        // caller polled its counts; the send half trusts them only if they are the landed ones\n"
               "        EP_HOST_ASSERT(num_worst_tokens == 0);\n"
               "        num_recv_tokens = cached_num_recv_tokens;\n"
               "        EP_HOST_ASSERT(num_recv_tokens >= 0 and num_recv_tokens == static_cast<int>(*moe_recv_counter));\n"
               "        rank_prefix_matrix = cached_rank_prefix_matrix.value();\n"
               "        channel_prefix_matrix = cached_channel_prefix_matrix.value();\n"
               "        num_recv_tokens_per_expert_list = std::vector<int>(moe_recv_expert_counter, moe_recv_expert_counter + num_local_experts);\n"
               "    } else {\n"
               "        rank_prefix_matrix = torch::empty({num_ranks, num_ranks}, dtype(torch::kInt32).device(torch::kCUDA));\n",
               "split_notify_counts")
    colo_patch(root, "csrc/deep_ep.cpp",
               '        .def("intranode_dispatch", &deep_ep::Buffer::intranode_dispatch)\n',
               "        // " + mark + " split_notify_bind\n"
               '        .def("intranode_notify", &deep_ep::Buffer::intranode_notify)\n'
               '        .def("intranode_notified_counts", &deep_ep::Buffer::intranode_notified_counts)\n'
               '        .def("intranode_dispatch", &deep_ep::Buffer::intranode_dispatch)\n',
               "split_notify_bind")


if __name__ == "__main__":
    colo_main(pathlib.Path(sys.argv[1]))
