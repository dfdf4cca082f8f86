#include "server/server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <random>
#include <thread>

#include <httplib.h>

#include "server/metrics.h"
#include "server/text_output.h"
#include "server/tool_calls.h"

namespace vireo::server {

namespace {

using clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(50);  // how often a waiting handler looks at its socket

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s%016llx%08llx", prefix, (unsigned long long)gen(),
                (unsigned long long)(gen() & 0xffffffffu));
  return buf;
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void send_error(httplib::Response& res, int status, const std::string& message, const std::string& param = "",
                const std::string& type = "", const std::string& code = "") {
  res.status = status;
  res.set_content(error_body(status, message, param, type, code), "application/json");
}

// "max_tokens: ..." -> "max_tokens": the field a scheduler error names.
std::string param_of(const std::string& message) {
  const size_t colon = message.find(':');
  if (colon == std::string::npos || colon == 0) return "";
  for (size_t i = 0; i < colon; ++i) {
    const char c = message[i];
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '[' || c == ']')) return "";
  }
  return message.substr(0, colon);
}

}  // namespace

// One generation request from submit to the end of its response.
struct Session {
  ApiRequest req;
  std::shared_ptr<RequestHandle> handle;
  std::string id, model;
  int64_t created = 0;
  const Tokenizer* tokenizer = nullptr;
  TextOutput text;
  std::vector<int32_t> ids;
  std::string content;                // non-streaming: the whole text (with tools: streaming too)
  std::string reasoning;              // non-streaming, under a reasoning split: the reasoning's text
  ojson lp_content = ojson::array();  // chat logprobs entries (non-streaming: all; streaming: pending)
  ojson lp_tokens = ojson::array(), lp_values = ojson::array(), lp_top = ojson::array(), lp_offsets = ojson::array();
  size_t text_offset = 0;
  std::vector<int32_t> pending_ids;  // streaming: ids not yet sent (return_token_ids)
  std::string finish_reason;  // set when done
  bool done = false;
  bool sent_role = false;        // chat streaming: the first chunk (the role) is out
  bool sent_prompt_ids = false;  // completions streaming with return_token_ids: the prompt's ids are out
  int32_t tool_call_open = -1;   // with tools: the <tool_call> token's id
  // Streaming with tools, past the first <tool_call> token: that text decoded with the special
  // tokens spelled, read for calls as it comes.
  bool in_calls = false;
  std::optional<DecodeStream> call_text;
  std::optional<ToolCallReader> call_reader;
  int index = 0;  // the choice's index (n > 1)
  clock::time_point last_token;

  Session(ApiRequest r, const Tokenizer* tok)
      : req(std::move(r)),
        tokenizer(tok),
        text(tok, req.stop, req.think, req.starts_in_reasoning, req.include_stop, req.skip_special) {
    if (req.parse_tools && tok)
      if (const std::optional<uint32_t> id = tok->token_to_id("<tool_call>")) tool_call_open = int32_t(*id);
  }

  std::string token_string(int32_t id) const {
    if (!tokenizer) return "token_id:" + std::to_string(id);
    const uint32_t u = uint32_t(id);
    return tokenizer->decode(std::span<const uint32_t>(&u, 1), false);
  }
  static ojson bytes_of(const std::string& s) {
    ojson b = ojson::array();
    for (unsigned char c : s) b.push_back(int(c));
    return b;
  }
  void add_logprobs(const SchedEvent& ev, const std::string& piece) {
    if (!req.sched.logprobs) return;
    const std::string tok = token_string(ev.token);
    if (req.chat) {
      ojson top = ojson::array();
      for (const TokenLogprob& t : ev.top) {
        const std::string s = token_string(t.id);
        top.push_back({{"token", s}, {"logprob", t.logprob}, {"bytes", bytes_of(s)}});
      }
      lp_content.push_back({{"token", tok}, {"logprob", ev.logprob}, {"bytes", bytes_of(tok)}, {"top_logprobs", top}});
    } else {
      lp_tokens.push_back(tok);
      lp_values.push_back(ev.logprob);
      ojson top = ojson::object();
      for (const TokenLogprob& t : ev.top) top[token_string(t.id)] = t.logprob;
      lp_top.push_back(top);
      lp_offsets.push_back(text_offset);
    }
    text_offset += piece.size();
  }
  // echo with logprobs: prompt token `id`, with its event's logprob and alternatives, or none (the
  // first prompt token, which nothing predicts). Offsets advance by the token's own text.
  void add_prompt_logprob(int32_t id, const SchedEvent* ev) {
    const std::string tok = token_string(id);
    lp_tokens.push_back(tok);
    lp_values.push_back(ev ? ojson(ev->logprob) : ojson(nullptr));
    ojson top = ev ? ojson::object() : ojson(nullptr);
    if (ev)
      for (const TokenLogprob& t : ev->top) top[token_string(t.id)] = t.logprob;
    lp_top.push_back(top);
    lp_offsets.push_back(text_offset);
    text_offset += tok.size();
  }
  // The pending logprobs as the response's logprobs object (and clears them).
  ojson take_logprobs() {
    if (!req.sched.logprobs) return nullptr;
    ojson out;
    if (req.chat) {
      out = {{"content", std::exchange(lp_content, ojson::array())}};
    } else {
      out = {{"tokens", std::exchange(lp_tokens, ojson::array())},
             {"token_logprobs", std::exchange(lp_values, ojson::array())},
             {"top_logprobs", std::exchange(lp_top, ojson::array())},
             {"text_offset", std::exchange(lp_offsets, ojson::array())}};
    }
    return out;
  }
  // Something a chunk must carry even with no text: logprobs, or ids (return_token_ids).
  bool has_pending() const {
    return (req.sched.logprobs && (req.chat ? !lp_content.empty() : !lp_tokens.empty())) ||
           (req.return_token_ids && !pending_ids.empty());
  }
};

struct HttpServer::Impl {
  ServerOptions opt;
  httplib::Server svr;
  std::thread listener;
  std::atomic<bool> is_ready{false}, stopping{false}, listener_done{false};
  ServedModel model;
  Scheduler* scheduler = nullptr;
  Metrics metrics;
  int64_t created = unix_time();

  explicit Impl(const ServerOptions& o) : opt(o) { routes(); }

  bool authorized(const httplib::Request& req, httplib::Response& res) {
    if (opt.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + opt.api_key) return true;
    send_error(res, 401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')", "",
               "invalid_request_error", "invalid_api_key");
    return false;
  }

  void routes() {
    const int threads = std::max(4, opt.http_threads);
    svr.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
    svr.set_payload_max_length(opt.max_body_bytes);
    svr.set_keep_alive_timeout(5);
    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      const bool guarded = req.path.rfind("/v1/", 0) == 0 || req.path == "/tokenize" || req.path == "/detokenize";
      if (guarded && !authorized(req, res)) {
        metrics.request(res.status);
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    // Every error leaves in OpenAI's shape, including those httplib produces itself (404, 413, 400).
    svr.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string msg;
      if (res.status == 404) msg = "no route for " + req.method + " " + req.path;
      else if (res.status == 413) msg = str("the request body exceeds the limit of ", opt.max_body_bytes, " bytes");
      else msg = str("HTTP error ", res.status);
      res.set_content(error_body(res.status, msg), "application/json");
      metrics.request(res.status);
    });
    svr.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string msg = "internal error";
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        msg = std::string("internal error: ") + e.what();
      } catch (...) {
      }
      send_error(res, 500, msg);
      metrics.request(500);
    });
    svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      if (!is_ready.load()) return send_error(res, 503, "the model is loading", "", "service_unavailable");
      res.set_content(R"({"status":"ok"})", "application/json");
    });
    svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      std::string body;
      if (is_ready.load()) {
        const SchedulerStats s = scheduler->stats();
        body = metrics.render(&s);
      } else {
        body = metrics.render(nullptr);
      }
      res.set_content(body, "text/plain; version=0.0.4");
    });
    svr.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      if (!is_ready.load()) return send_error(res, 503, "the model is loading", "", "service_unavailable");
      ojson m = {{"id", model.name}, {"object", "model"}, {"created", created}, {"owned_by", "vireo"},
                 {"max_model_len", model.context}};
      res.set_content(ojson{{"object", "list"}, {"data", ojson::array({m})}}.dump(), "application/json");
      metrics.request(200);
    });
    // vLLM's token counting endpoints: the tokenizer and chat template alone.
    for (const bool to_ids : {true, false})
      svr.Post(to_ids ? "/tokenize" : "/detokenize",
               [this, to_ids](const httplib::Request& req, httplib::Response& res) {
                 if (!is_ready.load()) return send_error(res, 503, "the model is loading", "", "service_unavailable");
                 try {
                   res.set_content((to_ids ? tokenize(req.body, model) : detokenize(req.body, model)).dump(),
                                   "application/json");
                   metrics.request(200);
                 } catch (const ApiError& e) {
                   send_error(res, e.status, e.what(), e.param, e.type, e.code);
                   metrics.request(e.status);
                 }
               });
    svr.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { generate(req, res, false); });
    svr.Post("/v1/chat/completions",
             [this](const httplib::Request& req, httplib::Response& res) { generate(req, res, true); });
  }

  // A request's choices: one Session each (n > 1: n scheduler requests, choice i seeded seed + i).
  using Choices = std::vector<std::shared_ptr<Session>>;

  void generate(const httplib::Request& http, httplib::Response& res, bool chat) {
    if (!is_ready.load() || stopping.load()) {
      send_error(res, 503, stopping ? "the server is shutting down" : "the model is loading", "", "service_unavailable");
      metrics.request(503);
      return;
    }
    auto choices = std::make_shared<Choices>();
    try {
      ApiRequest r = parse_request(http.body, chat, model);
      for (size_t p = 0; p < r.prompts.size(); ++p)
        for (int i = 0; i < r.n; ++i) {
          ApiRequest one = r;
          one.sched.prompt = r.prompts[p];
          one.prompts.clear();
          one.prompt_texts.clear();
          if (r.echo) one.prompt_texts = {r.prompt_texts[p]};
          one.sched.sampling.seed = r.sched.sampling.seed + uint64_t(i);
          choices->push_back(std::make_shared<Session>(std::move(one), model.tokenizer.get()));
          choices->back()->index = int(p) * r.n + i;
        }
      for (auto& s : *choices) s->handle = scheduler->submit(s->req.sched);
    } catch (const ApiError& e) {
      cancel_all(*choices);
      send_error(res, e.status, e.what(), e.param, e.type, e.code);
      metrics.request(e.status);
      return;
    } catch (const Error& e) {
      cancel_all(*choices);
      send_error(res, 400, e.what(), param_of(e.what()));
      metrics.request(400);
      return;
    }
    const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
    for (auto& s : *choices) {
      s->id = id;
      s->model = model.name;
      s->created = unix_time();
    }
    const ApiRequest& req = choices->front()->req;
    metrics.request(200);
    for (size_t i = 0; i < choices->size(); i += size_t(req.n))
      metrics.prompt_tokens(int64_t((*choices)[i]->req.sched.prompt.size()));
    if (req.stream) {
      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
    }
    res.set_chunked_content_provider(
        req.stream ? "text/event-stream" : "application/json",
        [this, choices](size_t, httplib::DataSink& sink) { return run(*choices, sink); },
        [this, choices](bool) {
          // Always: a stop string, a vanished client or shutdown all end the scheduler's work here.
          for (auto& s : *choices) {
            s->handle->cancel();
            if (!s->done) {
              s->done = true;
              metrics.finished("cancelled");
              metrics.generated_tokens(int64_t(s->ids.size()));
            }
          }
        });
  }

  static void cancel_all(const Choices& choices) {
    for (const auto& s : choices)
      if (s->handle) s->handle->cancel();
  }

  static bool write(httplib::DataSink& sink, const std::string& data) { return sink.write(data.data(), data.size()); }
  static bool sse(httplib::DataSink& sink, const ojson& chunk) { return write(sink, "data: " + chunk.dump() + "\n\n"); }

  ojson chunk_base(const Session& s) const {
    return {{"id", s.id}, {"object", s.req.chat ? "chat.completion.chunk" : "text_completion"}, {"created", s.created},
            {"model", s.model}};
  }

  // A chat chunk's delta: the role in the choice's first one.
  static ojson new_delta(Session& s) {
    ojson delta = ojson::object();
    if (!std::exchange(s.sent_role, true)) delta["role"] = "assistant";
    return delta;
  }

  // A streaming chunk carrying `piece` (and pending logprobs / ids); finish_reason when final.
  // reasoning: the piece is the reply's reasoning (delta.reasoning_content).
  bool send_chunk(Session& s, httplib::DataSink& sink, const std::string& piece, const char* finish,
                  bool reasoning = false) {
    ojson c = chunk_base(s);
    ojson choice = {{"index", s.index}};
    if (s.req.chat) {
      ojson delta = new_delta(s);
      if (!piece.empty() || (!finish && !reasoning)) delta[reasoning ? "reasoning_content" : "content"] = piece;
      choice["delta"] = delta;
    } else {
      choice["text"] = piece;
    }
    choice["logprobs"] = s.take_logprobs();
    choice["finish_reason"] = finish ? ojson(finish) : ojson(nullptr);
    if (s.req.return_token_ids && !s.req.chat && !s.sent_prompt_ids) {
      choice["prompt_token_ids"] = s.req.sched.prompt;
      s.sent_prompt_ids = true;
    }
    if (s.req.return_token_ids) choice["token_ids"] = std::exchange(s.pending_ids, {});
    c["choices"] = ojson::array({choice});
    return send_with_usage(s, sink, c);
  }

  // A chunk sent with the usage stream_options ask of every chunk: continuous_usage_stats, this
  // choice's so far; include_usage, null (the usage comes in a last chunk of its own).
  static bool send_with_usage(const Session& s, httplib::DataSink& sink, ojson& c) {
    if (s.req.continuous_usage) {
      const int64_t p = int64_t(s.req.sched.prompt.size()), n = int64_t(s.ids.size());
      c["usage"] = {{"prompt_tokens", p}, {"completion_tokens", n}, {"total_tokens", p + n}};
    } else if (s.req.include_usage) {
      c["usage"] = nullptr;
    }
    return sse(sink, c);
  }

  // With tools, the choice's GLM-5 tool calls as OpenAI's tool_calls (empty: none), *content then
  // the text before the first <tool_call> (the calls are special tokens, which the text skips).
  // Calls are read in the content only, not in the reasoning before it.
  static ojson tool_calls(const Session& s, std::string* content) {
    ojson out = ojson::array();
    if (!s.req.parse_tools || !s.tokenizer) return out;
    const std::vector<int32_t> ids(s.ids.begin() + std::ptrdiff_t(s.text.content_start()), s.ids.end());
    for (const ToolCall& c : split_tool_calls(*s.tokenizer, ids, content, s.req.parallel_tool_calls ? SIZE_MAX : 1,
                                              s.req.tool_string_params, s.req.skip_special))
      out.push_back({{"id", random_id("call_")},
                     {"type", "function"},
                     {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    return out;
  }

  // Streaming with tools: the text of `token` (past the first <tool_call>) read for calls, and
  // their deltas sent, a chunk a call; a null token: the end of generation.
  bool send_call_deltas(Session& s, httplib::DataSink& sink, const int32_t* token) {
    const std::string text = token ? s.call_text->step(uint32_t(*token)) : s.call_text->finish();
    for (const ToolCallDelta& d : s.call_reader->feed(text)) {
      ojson call = {{"index", d.index}};
      if (d.starts) {
        call["id"] = random_id("call_");
        call["type"] = "function";
        call["function"] = {{"name", d.name}, {"arguments", d.arguments}};
      } else {
        call["function"] = {{"arguments", d.arguments}};
      }
      ojson c = chunk_base(s);
      ojson delta = new_delta(s);
      delta["tool_calls"] = ojson::array({call});
      c["choices"] = ojson::array(
          {{{"index", s.index}, {"delta", std::move(delta)}, {"logprobs", nullptr}, {"finish_reason", nullptr}}});
      if (!send_with_usage(s, sink, c)) return false;
    }
    return true;
  }

  ojson whole_response(Choices& choices) {
    const Session& first = *choices.front();
    ojson all = ojson::array();
    for (auto& sp : choices) {
      Session& s = *sp;
      ojson choice = {{"index", s.index}};
      std::string content = s.content, finish = s.finish_reason;
      ojson calls = tool_calls(s, &content);
      if (!calls.empty()) finish = "tool_calls";
      if (s.req.chat) {
        choice["message"] = {{"role", "assistant"},
                             {"content", calls.empty() || !content.empty() ? ojson(content) : ojson(nullptr)}};
        if (s.req.think.splits() && s.req.include_reasoning)
          choice["message"]["reasoning_content"] = s.reasoning.empty() ? ojson(nullptr) : ojson(s.reasoning);
        if (!calls.empty()) choice["message"]["tool_calls"] = calls;
      } else {
        choice["text"] = content;
      }
      choice["logprobs"] = s.take_logprobs();
      choice["finish_reason"] = finish;
      if (s.req.return_token_ids && !s.req.chat) choice["prompt_token_ids"] = s.req.sched.prompt;  // its own (vLLM's)
      if (s.req.return_token_ids) choice["token_ids"] = s.ids;
      all.push_back(std::move(choice));
    }
    ojson r = {{"id", first.id},
               {"object", first.req.chat ? "chat.completion" : "text_completion"},
               {"created", first.created},
               {"model", first.model},
               {"choices", std::move(all)},
               {"usage", usage(choices)}};
    if (first.req.return_token_ids) r["prompt_token_ids"] = first.req.sched.prompt;
    return r;
  }

  // Each prompt once (the n choices of a prompt share it), every choice's completion tokens; under
  // a reasoning split, how many of them were reasoning (OpenAI's completion_tokens_details).
  static ojson usage(const Choices& choices) {
    int64_t p = 0, c = 0, reasoning = 0;
    for (size_t i = 0; i < choices.size(); ++i) {
      if (i % size_t(choices.front()->req.n) == 0) p += int64_t(choices[i]->req.sched.prompt.size());
      c += int64_t(choices[i]->ids.size());
      reasoning += int64_t(std::min(choices[i]->text.content_start(), choices[i]->ids.size()));
    }
    ojson u = {{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c}};
    if (choices.front()->req.think.splits()) u["completion_tokens_details"] = {{"reasoning_tokens", reasoning}};
    return u;
  }

  void end(Session& s, const std::string& reason) {
    s.done = true;
    s.finish_reason = reason;
    metrics.finished(reason);
    metrics.generated_tokens(int64_t(s.ids.size()));
  }

  // Drives a request's choices to their end, writing as they go (streaming) or at the end. Returns
  // false to abort the connection (the client is gone, or the server stops): the releaser cancels.
  bool run(Choices& choices, httplib::DataSink& sink) {
    const ApiRequest& req = choices.front()->req;
    const bool stream = req.stream;
    if (stream && req.chat)
      for (auto& s : choices)
        if (!send_chunk(*s, sink, "", nullptr)) return false;  // the role first
    if (req.echo)  // the prompt's text first (and with logprobs its first token's, which has none)
      for (auto& s : choices) {
        if (s->req.sched.prompt_logprobs) s->add_prompt_logprob(s->req.sched.prompt[0], nullptr);
        if (stream) {
          if (!send_chunk(*s, sink, s->req.prompt_texts[0], nullptr)) return false;
        } else {
          s->content = s->req.prompt_texts[0];
        }
      }
    // One choice waits on its events kPoll at a time; several poll each other in turn, waiting
    // briefly on the first unfinished one when none had an event.
    const auto wait = choices.size() == 1 ? kPoll : std::chrono::milliseconds(2);
    auto last_check = clock::now();
    std::optional<bool> ended;  // set by an event that ends the response: run's return value
    auto take = [&](Session& s, SchedEvent ev) {
      const Step step = on_event(s, std::move(ev), sink);
      if (step == Step::Abort) ended = false;
      if (step == Step::Failed) {
        cancel_all(choices);
        ended = true;
      }
      return !ended;
    };
    for (;;) {
      Session* first = nullptr;  // the first unfinished choice
      bool got = false;
      for (auto& sp : choices) {
        if (sp->done) continue;
        if (!first) first = sp.get();
        SchedEvent ev;
        if (!sp->handle->next(ev, std::chrono::milliseconds(0))) continue;
        got = true;
        if (!take(*sp, std::move(ev))) return *ended;
      }
      if (!first) break;
      if (stopping.load()) return false;
      if (!got && !first->done) {
        SchedEvent ev;
        if (first->handle->next(ev, wait)) {
          got = true;
          if (!take(*first, std::move(ev))) return *ended;
        }
      }
      if (!got || clock::now() - last_check > kPoll) {
        if (!sink.is_writable()) return false;
        last_check = clock::now();
      }
    }
    if (stream) {
      if (req.include_usage) {
        ojson c = chunk_base(*choices.front());
        c["choices"] = ojson::array();
        c["usage"] = usage(choices);
        if (!sse(sink, c)) return false;
      }
      if (!write(sink, "data: [DONE]\n\n")) return false;
    } else {
      if (!write(sink, whole_response(choices).dump())) return false;
    }
    sink.done();
    return true;
  }

  enum class Step { Go, Abort, Failed };

  // One scheduler event of choice s: its token (text, logprobs, a stop string), its end, or its
  // failure (written as the response's end: Failed).
  Step on_event(Session& s, SchedEvent ev, httplib::DataSink& sink) {
    const bool stream = s.req.stream;
    TextPiece out;  // this event's text
    const char* finish = nullptr;
    if (ev.kind == SchedEvent::Kind::PromptToken) {  // echo: sent with the next chunk
      s.add_prompt_logprob(ev.token, &ev);
      return Step::Go;
    }
    if (s.req.echo && s.ids.empty()) s.text_offset = s.req.prompt_texts[0].size();  // the completion's offsets
    if (ev.kind == SchedEvent::Kind::Token) {
      const double since =
          std::chrono::duration<double>(ev.time - (s.ids.empty() ? s.handle->submitted() : s.last_token)).count();
      if (s.ids.empty()) metrics.ttft(since);
      else metrics.itl(since);
      s.last_token = ev.time;
      s.ids.push_back(ev.token);
      s.pending_ids.push_back(ev.token);
      out = ev.ends_by_id ? s.text.stop_token(ev.token) : s.text.token(ev.token);
      s.add_logprobs(ev, out.held_reasoning + out.text);
      if (s.text.stopped()) {
        s.handle->cancel();  // a stop string: the engine frees the row at its next step
        end(s, "stop");
        finish = "stop";
      }
    } else if (ev.kind == SchedEvent::Kind::Finish) {
      if (ev.reason == FinishReason::Cancelled) return Step::Abort;
      out = s.text.finish();
      const char* reason = ev.reason == FinishReason::Length && !s.text.stopped() ? "length" : "stop";
      end(s, reason);
      finish = reason;
    } else {
      end(s, "error");
      const std::string err = error_body(500, "generation failed: " + ev.message, "", "server_error");
      write(sink, stream ? "data: " + err + "\n\n" : err);
      sink.done();
      return Step::Failed;
    }
    // The reasoning's text: streamed as it comes (tools or not), or kept, or left out
    // (include_reasoning false; a chunk then carries only what is pending). Reasoning text withheld
    // past </think> (a possible stop string's start) and released with a content id goes first.
    if (!out.held_reasoning.empty() && s.req.include_reasoning) {
      if (!stream) s.reasoning += out.held_reasoning;
      else if (!send_chunk(s, sink, out.held_reasoning, nullptr, true)) return Step::Abort;
    }
    const bool reasoning = out.reasoning;
    if (reasoning && !s.req.include_reasoning) out.text.clear();
    if (reasoning && !stream) s.reasoning += out.text;
    const std::string piece = reasoning && !stream ? std::string() : std::move(out.text);
    // Streaming with tools: the content goes out as it comes up to the first <tool_call> token; from
    // there on the text is read for calls, whose deltas go out as they are read (a call's name,
    // then its arguments in pieces). The text itself is held: at the end, where no call started,
    // it is sent as content, as a reply that does not stream has it.
    if (stream && s.req.parse_tools && !reasoning && ev.kind == SchedEvent::Kind::Token &&
        ev.token == s.tool_call_open && !s.in_calls) {
      s.in_calls = true;
      s.call_text.emplace(*s.tokenizer, /*skip_special_tokens=*/false);
      s.call_reader.emplace(s.req.tool_string_params, s.req.parallel_tool_calls ? SIZE_MAX : 1);
    }
    if (stream && s.in_calls) {
      s.content += piece;
      if (ev.kind == SchedEvent::Kind::Token && !send_call_deltas(s, sink, &ev.token)) return Step::Abort;
      if (!finish) return Step::Go;
      if (!send_call_deltas(s, sink, nullptr)) return Step::Abort;
      const std::string held = s.call_reader->calls_started() == 0 ? s.content : std::string();
      if (!held.empty() || s.has_pending())
        if (!send_chunk(s, sink, held, nullptr)) return Step::Abort;
      if (!send_chunk(s, sink, "", s.call_reader->calls().empty() ? finish : "tool_calls")) return Step::Abort;
    } else if (stream) {
      if (finish) {
        if (!piece.empty() || s.has_pending())
          if (!send_chunk(s, sink, piece, nullptr, reasoning)) return Step::Abort;
        if (!send_chunk(s, sink, "", finish)) return Step::Abort;
      } else if (!piece.empty() || s.has_pending()) {
        if (!send_chunk(s, sink, piece, nullptr, reasoning)) return Step::Abort;
      }
    } else {
      s.content += piece;
    }
    return Step::Go;
  }
};

HttpServer::HttpServer(const ServerOptions& opt) : impl_(std::make_unique<Impl>(opt)) {}

HttpServer::~HttpServer() {
  if (!stop(std::chrono::hours(1))) std::abort();  // unreachable: the wait is unbounded in practice
}

int HttpServer::bind() {
  Impl& m = *impl_;
  if (m.opt.port == 0) {
    const int port = m.svr.bind_to_any_port(m.opt.host);
    if (port <= 0) fail("--host ", m.opt.host, ": cannot bind a port");
    m.opt.port = port;
  } else if (!m.svr.bind_to_port(m.opt.host, m.opt.port)) {
    fail("--host ", m.opt.host, " --port ", m.opt.port, ": cannot bind (in use, or not a local address)");
  }
  return m.opt.port;
}

void HttpServer::start() {
  impl_->listener = std::thread([this] {
    impl_->svr.listen_after_bind();
    impl_->listener_done.store(true);
  });
}

void HttpServer::ready(ServedModel model, Scheduler& scheduler) {
  impl_->model = std::move(model);
  impl_->scheduler = &scheduler;
  impl_->is_ready.store(true);
}

bool HttpServer::stop(std::chrono::milliseconds grace) {
  if (!impl_ || !impl_->listener.joinable()) return true;
  impl_->stopping.store(true);
  impl_->svr.stop();
  // httplib joins its handler threads only once every idle keep-alive connection has timed out
  // or been closed by its client, which can take long; past the grace period report failure and
  // let the caller exit without waiting (every request has been cancelled by then).
  const auto deadline = clock::now() + grace;
  while (!impl_->listener_done.load() && clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!impl_->listener_done.load()) return false;
  impl_->listener.join();
  return true;
}

}  // namespace vireo::server
