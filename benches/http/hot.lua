-- wrk: one hot caller for every request (header x-api-key: hot)
request = function()
  return wrk.format("GET", "/api/hello", { ["x-api-key"] = "hot" })
end
